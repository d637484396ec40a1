"""What test_chaos.py and test_keda_sim.py import from here: the repository and the
environment of a subprocess (both in tests/support/service.py, whose fixtures
tests/conftest.py gives every folder)."""

from tests.support.service import REPO, subprocess_env

__all__ = ["REPO", "subprocess_env"]
