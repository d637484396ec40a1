"""The chaos check: ``python -m checks.chaos`` (``__main__.py``)."""
