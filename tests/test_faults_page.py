"""docs/faults.md states each guarantee with the test that proves it: every test it names
exists, and every test module of the containment guarantees is named there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "faults.md").read_text(encoding="utf-8")


def test_every_test_the_faults_page_names_exists() -> None:
    named = set(re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", PAGE))
    assert named
    for path, test in named:
        source = (REPO / path).read_text(encoding="utf-8")
        if test:
            assert re.search(rf"^(async )?def {test}\(", source, re.M), f"{path}::{test}"


def test_the_faults_page_names_the_tests_of_each_containment_guarantee() -> None:
    for module in (
        "tests/producer/test_cut_short.py",
        "tests/wire/test_forgery.py",
        "tests/wire/test_admission_rights.py",
        "tests/e2e/test_containment.py",
        "tests/worker/test_watchdog.py",
        "tests/generation/test_rows.py",
        "tests/generation/test_engine.py",
        "tests/contrib/test_body_limit.py",
        "tests/contrib/openai/test_openai_params.py",
        "tests/producer/test_flood.py",
    ):
        assert module in PAGE, module
