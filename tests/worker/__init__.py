"""Tests of batchline.worker: serving requests from a real redis-server, the models and their
backends, generation workers, upkeep (consumers, the watchdog), threads and metrics."""
