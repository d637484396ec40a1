"""The site's generated pages, made at build time (an mkdocs hook, ``hooks:`` in mkdocs.yml).

A page holds a marker where a generated part goes, and this hook puts it there:

- ``<!-- generated: settings CLASS -->``: a table of the fields that settings class of
  ``batchline.config`` declares: each name, type, default, environment variable, flag of
  ``batchline worker`` (where it is one) and description, from the class docstring's
  ``Attributes:`` section. Name, default and description are those ``--help`` shows.
- ``<!-- generated: cli -->``: every command of ``batchline`` with its usage and options,
  read from the argument parser itself.

Nothing generated is committed, so a setting or an option cannot be missing from the pages
or carry a wrong default.
"""

from __future__ import annotations

import html
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

import batchline.cli
import batchline.config

_MARKER = re.compile(r"^<!-- generated: (\w+)(?: (\w+))? -->$", re.M)


# -- what the command line shows: the one place that reads batchline.cli -----------------------
#
# The command's own record of its options (``batchline.cli.cli_reference()``) is what this
# page is made from, with each setting's help and default as ``--help`` shows them.


def shown_default(name: str, info: FieldInfo) -> str:
    """A setting's default as ``batchline worker --help`` shows it."""
    return batchline.cli.shown_default(name, info.default)


def field_docs(cls: type) -> dict[str, str]:
    """Each setting's description, as ``--help`` shows it (without its ``[env ...]`` part)."""
    return batchline.cli.field_docs(cls)


@dataclass(frozen=True)
class Option:
    """One option of a command: its flags, the value it takes, its help text."""

    flags: tuple[str, ...]
    value: str
    help: str
    dest: str


@dataclass(frozen=True)
class Command:
    """One command of ``batchline``: its name, what it does, its options."""

    name: str
    about: str
    options: tuple[Option, ...]


def commands() -> list[Command]:
    """``batchline`` and each of its commands, with their options."""
    return [_from_record(command) for command in batchline.cli.cli_reference()]


def _from_record(command: batchline.cli.CliCommand) -> Command:
    """A command as ``batchline.cli.cli_reference()`` records it."""
    options = []
    for o in command.options:
        suffix = "; ".join(
            part
            for part in (
                f"env {o.env}" if o.env else "",
                f"default {o.default}" if o.default is not None else "",
            )
            if part
        )
        text = f"{o.help} [{suffix}]" if suffix else o.help
        dest = o.name.lstrip("-").replace("-", "_")
        options.append(Option((o.name,), o.metavar or "", text, dest))
    name = str(command.name)
    return Command(name, str(command.description), tuple(options))


# -- the configuration tables -------------------------------------------------------------------


def _type_text(annotation: Any) -> str:
    """A field's type in words: ``integer``, ``auto | uvloop | asyncio``, ``text or none``."""
    if annotation is SecretStr:
        return "text (secret)"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_text(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " or ".join(_type_text(a) for a in parts)
        return text + " or none" if len(parts) < len(typing.get_args(annotation)) else text
    names = {int: "integer", float: "number", str: "text", bool: "`true` \\| `false`"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(info: FieldInfo) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}
    words["max_length"] = "length ≤"
    found = []
    for item in info.metadata:
        for attr, word in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{word} {value}")
    return ", ".join(found)


@dataclass(frozen=True)
class Setting:
    """One row of a configuration table."""

    name: str
    type: str
    default: str
    env: str
    flag: str | None
    doc: str


def settings(cls: type[BaseModel]) -> list[Setting]:
    """The fields ``cls`` declares itself (not those of its bases), in declaration order."""
    docs = field_docs(cls)
    flags = {o.dest: o.flags[0] for c in commands() for o in c.options if c.name.endswith("worker")}
    own = [name for name in cls.__annotations__ if name in cls.model_fields]
    rows = []
    for name in own:
        info = cls.model_fields[name]
        bounds = _bounds(info)
        kind = _type_text(info.annotation) + (f" ({bounds})" if bounds else "")
        prefix = batchline.config.ENV_PREFIX
        rows.append(
            Setting(
                name=name,
                type=kind,
                default=shown_default(name, info),
                env=prefix + name.upper(),
                flag=flags.get(name),
                doc=docs.get(name, ""),
            )
        )
    return rows


def _cell(text: str) -> str:
    """Docstring text (reST-style ````code````) as one markdown table cell: code as code,
    the rest with ``<``, ``>`` and ``&`` escaped, and no ``|`` that would end the cell."""
    parts = re.split(r"``(.+?)``", text)
    out = [f"`{p}`" if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts)]
    return "".join(out).replace("|", "\\|")


def settings_markdown(class_name: str) -> str:
    cls = getattr(batchline.config, class_name)
    lines = ['<div class="settings" markdown>', ""]
    lines += ["| setting | default, type | meaning |", "|---|---|---|"]
    for s in settings(cls):
        where = f'<span id="{s.name}">`{s.name}`</span><br>`{s.env}`'
        where += f"<br>`{s.flag}`" if s.flag else ""
        lines.append(f"| {where} | `{s.default}`<br>{s.type} | {_cell(s.doc)} |")
    return "\n".join([*lines, "", "</div>"])


def cli_markdown() -> str:
    parts = []
    for command in commands():
        parts += [f"## `{command.name}`", "", _cell(command.about), ""]
        parts += ['<div class="options" markdown>', ""]
        parts += ["| option | value | what it does |", "|---|---|---|"]
        for o in command.options:
            flags = ", ".join(f"`{f}`" for f in o.flags)
            value = f"`{o.value}`" if o.value else ""
            parts.append(f"| {flags} | {value} | {_cell(o.help)} |")
        parts += ["", "</div>", ""]
    return "\n".join(parts)


def expand(markdown: str) -> str:
    """The page with each ``<!-- generated: ... -->`` marker replaced by what it names."""

    def one(found: re.Match[str]) -> str:
        kind, arg = found.group(1), found.group(2)
        if kind == "settings" and arg:
            return settings_markdown(arg)
        if kind == "cli" and not arg:
            return cli_markdown()
        raise ValueError(f"unknown marker {found.group(0)!r}")

    return _MARKER.sub(one, markdown)


def generated_markers(markdown: str) -> Iterator[str]:
    for found in _MARKER.finditer(markdown):
        yield found.group(0)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs: fill a page's generated parts before it is rendered."""
    return expand(markdown)
