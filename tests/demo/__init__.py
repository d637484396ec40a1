"""Tests of ``batchline demo``."""
