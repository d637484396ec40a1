"""Tests of the Redis-streams service, against a real redis-server (see conftest.py).

A package, so that worker subprocesses can import the test models as ``module:callable``.
"""
