# Sourced by setup.sh, test.sh and demo.sh (in the checkout's root): sets py, the Python that
# setup.sh installs batchline into and the others run. $PYTHON, or python3; but where that one
# is externally managed (PEP 668: the system Python of Debian 12 and of Ubuntu 23.04 on, into
# which pip refuses to install) and not a virtual environment's, the virtual environment .venv
# here, which setup.sh makes from it: then venv=.venv, base_py is the interpreter it comes
# from, and .venv/bin is first on PATH, as activating it would put it.
py="${PYTHON:-python3}"
venv=""
base_py="$py"
# (setup.sh sets making_venv=1: it makes .venv; test.sh and demo.sh take an existing one only,
# else the interpreter as it is, into which batchline may have been installed another way.)
if { [ -n "${making_venv:-}" ] || [ -x .venv/bin/python ]; } \
    && "$py" -c 'import os, sys, sysconfig; sys.exit(sys.prefix != sys.base_prefix or not os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))' 2>/dev/null; then
    venv=.venv
    py="$venv/bin/python"
    PATH="$PWD/$venv/bin:$PATH"
fi
