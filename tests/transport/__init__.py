"""Tests of batchline.transport: the Redis I/O (admission, cancels, status, the loop, the
outbox, Sentinel URLs), against a real redis-server where they need one."""
