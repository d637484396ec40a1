"""Integrations with other frameworks; each needs its own extra (``batchline[web]``: FastAPI).

Nothing here is imported by ``import batchline``: import the module you use, e.g.
``from batchline.contrib.fastapi import create_app``.
"""
