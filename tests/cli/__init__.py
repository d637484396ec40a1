"""Tests of the ``batchline`` command line."""
