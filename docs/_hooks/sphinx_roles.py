"""A Griffe extension for the API reference: the docstrings' Sphinx roles
(``:class:`~batchline.config.WebSettings```, ``:func:`x```) shown as code, as Python's own
tools show them, instead of as the role's raw text. ``~`` keeps the last name only."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([\w.]+)`")


def plain(text: str) -> str:
    """The text with each role replaced by the name it refers to, as inline code."""
    return _ROLE.sub(
        lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", text
    )


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
