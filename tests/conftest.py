"""The fixtures every test folder sees: the service's (a real redis-server, per-test queues,
workers), from tests/support/service.py. The driver tests' own are in drivers/conftest.py."""

pytest_plugins = ["tests.support.service"]
