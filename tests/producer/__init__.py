"""Tests of batchline.producer: writing requests and waiting on them, replies, timeouts,
streams, answers computed once, and a bounded queue under a flood."""
