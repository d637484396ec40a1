#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite in two lanes: the fast lane
# (pytest -m "not slow": every test module, at most 90 s on a 2-core machine), its wall time
# printed, then the slow tests (-m slow). Both always run; the exit status is non-zero if
# either failed. With arguments, one pytest run with them instead (e.g. a path, -k or -m).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash scripts/setup.sh
. scripts/python.sh  # py: $PYTHON or python3, or the .venv setup.sh made beside a system Python
if [ "$#" -gt 0 ]; then
    exec "$py" -m pytest -q -p no:cacheprovider "$@"
fi
lane() {  # lane NAME MARKER: one pytest run, then its wall time and exit status
    local started=$SECONDS status=0
    "$py" -m pytest -q -p no:cacheprovider -m "$2" || status=$?
    echo "$1 lane: $((SECONDS - started)) s (exit status $status)"
    return "$status"
}
fast=0 slow=0
lane fast "not slow" || fast=$?
lane slow slow || slow=$?
[ "$fast" = 0 ] && [ "$slow" = 0 ]
