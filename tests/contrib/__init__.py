"""Tests of batchline.contrib: the FastAPI backend and its OpenAI-compatible routes, over real
HTTP."""
