"""The container check: ``python -m checks.containers`` (``__main__.py``)."""
