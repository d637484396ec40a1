"""The serving path of a worker, in the order a request passes: the admitter moves what
producers enqueued into the work streams; the reader takes entries (within the read cap),
the intake decodes and preprocesses them, an executor runs the model (the asyncio batcher, or
continuous batching for generation), the answers are made and the writer (and, for streams,
the chunk writer) puts them in Redis; the claims are what the worker holds meanwhile, and the
cache the answers computed once."""
