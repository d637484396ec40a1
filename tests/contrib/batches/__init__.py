"""Tests of the Batch API wing: ``/v1/files`` and ``/v1/batches``, the driver, uploads."""
