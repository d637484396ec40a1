"""The fixtures every test folder sees: the service's (a real redis-server, per-test queues,
workers), from tests/support/service.py, and tenants' configs (tests/support/quota.py). The
driver tests' own are in drivers/conftest.py."""

pytest_plugins = ["tests.support.service", "tests.support.quota"]
