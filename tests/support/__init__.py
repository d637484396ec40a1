"""What several test folders share: the service fixtures (a real redis-server, queues,
workers: service.py, a pytest plugin named in tests/conftest.py), batch functions and
scripts that tests hand to workers or run as processes, and helpers of the driver and
generation tests."""
