"""Tests of the in-process drivers: the thread driver (test_thread_*), the asyncio driver
(test_aio_*), what both promise alike (test_both_drivers) and batchline.inference, end to
end through the public API."""
