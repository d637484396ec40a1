"""The ``batchline`` command (the console script, and ``python -m batchline``).

:func:`main` runs it; :func:`cli_reference` is its record of every command and option
(:class:`CliCommand`, :class:`CliOption`), which the documentation's CLI page is generated
from, with each setting's help (:func:`field_docs`) and default (:func:`shown_default`)
as ``--help`` shows them.
"""

from batchline.cli._main import cli_reference, command_settings, main
from batchline.cli._options import CliCommand, CliOption, field_docs, shown_default

__all__ = [
    "CliCommand",
    "CliOption",
    "cli_reference",
    "command_settings",
    "field_docs",
    "main",
    "shown_default",
]
