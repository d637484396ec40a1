"""``import batchline.producer`` without the ``service`` extra (msgpack missing, here) raises
an ImportError that names the extra to install, not msgpack's bare ModuleNotFoundError."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.service import subprocess_env

IMPORT = """
import sys
sys.modules[{module!r}] = None  # as if it were not installed
try:
    import batchline.producer
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    print("imported")
"""


@pytest.mark.parametrize("module", ["msgpack", "pydantic_settings"])
def test_a_producer_without_the_service_extra_says_which_to_install(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT.format(module=module)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"ImportError batchline.producer needs the service extra (no module {module!r}): "
        "pip install 'batchline[service]'"
    ), done.stdout
