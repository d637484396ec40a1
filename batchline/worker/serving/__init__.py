"""The serving path of a worker, in the order a request passes: the admitter
(:mod:`._admitter`) moves what producers enqueued into the work streams; the reader
(:mod:`._reader`) takes entries within the read cap and hands them to :class:`Serving
<._serving.Serving>` (:mod:`._serving`), which owns each request's way from there: the intake
(:mod:`._intake`) decodes and preprocesses it, an executor (:mod:`._executors`: the asyncio
batcher, or continuous batching for generation, :mod:`._generation_executor`) runs the model,
its calls stamped as they start (:mod:`._starts`), the answers are made (:mod:`._answers`)
and the writer (:mod:`._writer`; for streams, the chunk writer, :mod:`._chunk_writer`) puts
them in Redis, filling the cache of answers computed once where it may.
Beside it, the model's facts published for the API (:mod:`._facts`). What it holds meanwhile,
and its model calls' guard, are in :mod:`batchline.worker.shared`, below it and the upkeep."""
