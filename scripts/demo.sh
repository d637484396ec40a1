#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the demo: `batchline demo`. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || BATCHLINE_EXTRAS="${BATCHLINE_EXTRAS:-redis,embed,service,demo}" bash scripts/setup.sh
. scripts/python.sh
exec "$py" -m batchline demo "$@"
