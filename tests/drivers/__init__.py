"""Tests of the in-process drivers: the thread driver (test_thread_*), the asyncio driver
(test_aio_*) and batchline.inference, end to end through the public API."""
