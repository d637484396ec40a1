"""Tests of batchline.core: batch forming, padding, pacing and statistics, pure (no threads,
no Redis)."""
