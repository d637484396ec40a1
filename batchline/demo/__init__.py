"""``batchline demo``: the in-process batcher (:mod:`.inprocess`) and the whole service on
one machine (:mod:`.service`), chat prompts answered by a text-generation worker
(:mod:`.generate`), with generated sentences (:mod:`.sentences`) and a private
redis-server (:mod:`.embedded`)."""

from batchline.demo.inprocess import run_demo

__all__ = ["run_demo"]
