"""The suite's lanes say why they skip what they skip: pytest's summary lists each skipped
test with its reason (what it needs that is missing here), the fast lane's included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_skipped_test_is_listed_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.skip(reason='needs a thing this machine lacks')\n"
        "def test_skipped() -> None:\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "-p"]
        + ["no:cacheprovider", "--rootdir", str(tmp_path), "-m", "not slow", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED [1] " in done.stdout, done.stdout
    assert ": needs a thing this machine lacks" in done.stdout, done.stdout
