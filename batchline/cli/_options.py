"""The options of the ``batchline`` command, each documented once: the help text ``--help``
shows and the record :func:`batchline.cli.cli_reference` returns are made from the same
:class:`CliOption`, attached to the parser's own argument. A command's settings are read
from its flags and the environment here too (:func:`read_settings`), a bad one a
:class:`UsageError`.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

__all__ = [
    "CliCommand",
    "CliOption",
    "UsageError",
    "add_option",
    "add_settings",
    "field_docs",
    "positive",
    "read_settings",
    "reference",
    "settings_from",
    "shown_default",
]

_ATTR = "batchline_option"  # where an argparse action keeps its CliOption


@dataclass(frozen=True, slots=True)
class CliOption:
    """One option of a command, as its ``--help`` shows it.

    Attributes:
        name: the flag, e.g. ``--batch-size``.
        help: what it does (its default and variable are the next two fields).
        default: the default as the help writes it; None for a switch (off unless given)
            and for an option that is unset unless given.
        env: the environment variable that sets it when the flag is not given, if any.
        metavar: how the help writes its value (``{true,false}``, ``URL``), None for a switch.
        choices: the values it accepts, where they are a fixed few.
    """

    name: str
    help: str
    default: str | None
    env: str | None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class CliCommand:
    """One command: ``batchline`` itself (the options before a command), or a subcommand.

    Attributes:
        name: as typed, e.g. ``batchline worker``.
        description: what it does, as the top of its ``--help``.
        options: its options, in the order its ``--help`` lists them.
    """

    name: str
    description: str
    options: tuple[CliOption, ...]


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    text: str,
    shown: str | None = None,
    env: str | None = None,
    choices: Sequence[str] | None = None,
    accepts: Sequence[str] | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Add ``flag`` to ``parser`` with the help ``text [env ENV; default SHOWN]``.

    ``choices`` are enforced by the parser; ``accepts`` only documents a setting's values
    (its settings class validates them, naming the setting).
    """
    suffix = "; ".join(
        part
        for part in (f"env {env}" if env else "", f"default {shown}" if shown is not None else "")
        if part
    )
    full = f"{text} [{suffix}]" if suffix else text
    if choices is not None:
        kwargs["choices"] = list(choices)
    values = tuple(choices or accepts or ()) or None
    if values and "metavar" not in kwargs:
        kwargs["metavar"] = "{" + ",".join(values) + "}"
    action = parser.add_argument(flag, help=full.replace("%", "%%"), **kwargs)
    switch = action.nargs == 0
    option = CliOption(
        name=flag,
        help=text,
        default=shown,
        env=env,
        metavar=None if switch else str(action.metavar or action.dest.upper()),
        choices=values,
    )
    setattr(action, _ATTR, option)
    return action


#: What ``--help`` shows as a setting's default where the value itself (none) says too little.
_SHOWN_DEFAULTS = {
    "model_path": "all-MiniLM-L6-v2",
    "worker_id": "host-pid-random",
    "threads": "available cores",
}
_METAVARS = {
    "redis_url": "URL",
    "model": "MODEL",
    "model_path": "PATH",
    "calibration": "FILE",
    "queue": "NAME",
    "prefix": "NAME",
    "worker_id": "NAME",
    "device": "DEVICE",
}


def _metavar(name: str, annotation: Any) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    if name.endswith("_ms"):
        return "MS"
    if name.endswith("_s"):
        return "SECONDS"
    return "N" if int in (annotation, *typing.get_args(annotation)) else "VALUE"


def shown_default(name: str, value: Any) -> str:
    """A setting's default as the help writes it."""
    if name in _SHOWN_DEFAULTS and value is None:
        return _SHOWN_DEFAULTS[name]
    if name == "redis_url":  # the default holds no password; a given URL is never shown
        return str(value.get_secret_value())
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def field_docs(cls: type) -> dict[str, str]:
    """Each setting's description, from the ``Attributes:`` sections of the class docstrings
    (reST literals written plainly)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = inspect.cleandoc(klass.__doc__ or "")
        if "Attributes:" not in text:
            continue
        name = None
        for line in text.split("Attributes:", 1)[1].splitlines():
            match = re.match(r"^    (\w+): (.*)$", line)
            if match:
                name = match.group(1)
                docs[name] = match.group(2)
            elif name and line.startswith("        "):
                docs[name] += " " + line.strip()
            elif line.strip():
                name = None
    return {name: text.replace("``", "") for name, text in docs.items()}


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values of a ``Literal`` setting (``true``/``false`` for a bool)."""
    if annotation is bool:
        return ("true", "false")
    if typing.get_origin(annotation) is Literal:
        return tuple(str(v) for v in typing.get_args(annotation))
    return None


def add_settings(
    parser: argparse.ArgumentParser,
    cls: Any,
    names: Sequence[str],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """A flag per setting in ``names`` of the settings class ``cls``; ``defaults`` replaces
    a setting's default for this command (:func:`settings_from` applies it)."""
    docs = field_docs(cls)
    for name in names:
        info = cls.model_fields[name]
        accepts = _choices(info.annotation)
        value = (defaults or {}).get(name, info.default)
        add_option(
            parser,
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            text=docs[name],
            shown=shown_default(name, value),
            env=f"BATCHLINE_{name.upper()}",
            accepts=accepts,
            **({} if accepts else {"metavar": _metavar(name, info.annotation)}),
        )


def settings_from(cls: Any, args: argparse.Namespace, defaults: Mapping[str, Any]) -> Any:
    """The settings ``cls`` from the flags given, else the environment, else ``defaults``
    (this command's own), else the class's defaults."""
    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    environ = {k.upper() for k in os.environ}
    for name, value in defaults.items():
        if name not in given and f"BATCHLINE_{name.upper()}" not in environ:
            given[name] = value
    return cls(**given)


class UsageError(ValueError):
    """A bad option, setting or file, or options that do not go together (exit status 2 and
    one line, as the parser's own errors)."""


def read_settings(
    cls: Any, args: argparse.Namespace, defaults: Mapping[str, Any] | None = None
) -> Any:
    """:func:`settings_from`, with the environment checked first; UsageError naming each
    invalid setting."""
    from batchline.config import check_environment

    try:
        check_environment()
        return settings_from(cls, args, defaults or {})
    except ValidationError as exc:
        problems = "; ".join(_problem(error, args) for error in exc.errors())
        raise UsageError(f"invalid settings: {problems}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _problem(error: Any, args: argparse.Namespace) -> str:
    """One invalid setting: the flag or the variable that gave it, what is wrong, and (but
    for the URL, which may hold a password) the value."""
    name = str(error["loc"][0]) if error["loc"] else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not name:
        return f"settings: {message}"
    given = getattr(args, name, None)
    where = f"--{name.replace('_', '-')}" if given is not None else f"BATCHLINE_{name.upper()}"
    shown = given if given is not None else os.environ.get(f"BATCHLINE_{name.upper()}")
    if name != "redis_url" and shown is not None and "got " not in message:
        message += f", got {shown!r}"
    return f"{where}: {message}"


def _options(parser: argparse.ArgumentParser) -> tuple[CliOption, ...]:
    options = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(
            action, argparse._HelpAction | argparse._SubParsersAction
        ):
            continue
        option = getattr(action, _ATTR, None)
        if not isinstance(option, CliOption):
            raise RuntimeError(f"{parser.prog} {action.option_strings}: added without its doc")
        options.append(option)
    return tuple(options)


def reference(
    parser: argparse.ArgumentParser, commands: Mapping[str, argparse.ArgumentParser]
) -> tuple[CliCommand, ...]:
    """The top-level parser's options, then each command's."""
    return tuple(
        CliCommand(name=p.prog, description=p.description or "", options=_options(p))
        for p in (parser, *commands.values())
    )


def positive(kind: type[int] | type[float]) -> Any:
    """An argparse ``type``: a number of ``kind`` above 0, else the one-line error."""

    def read(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a{'n integer' if kind is int else ' number'} above 0, got {text!r}"
            ) from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
        return value

    read.__name__ = kind.__name__
    return read
