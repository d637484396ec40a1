"""The configuration and command-line pages, generated at build time by docs/_hooks/
generated.py: every setting of the settings models and every option of the parser is there,
with the default and the text ``--help`` shows."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import pytest

from batchline.cli import cli_reference
from batchline.config import ProducerSettings, ServiceSettings, WebSettings, WorkerSettings

from tests.support.service import REPO, run_cli


def _hook() -> ModuleType:
    path = REPO / "docs" / "_hooks" / "generated.py"
    spec = importlib.util.spec_from_file_location("docs_hook_generated", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


HOOK = _hook()
CONFIGURATION = HOOK.expand((REPO / "docs" / "configuration.md").read_text(encoding="utf-8"))
CLI = HOOK.expand((REPO / "docs" / "cli.md").read_text(encoding="utf-8"))


def _table() -> dict[str, tuple[str, str]]:
    """Each setting of the configuration page: its default and its variable, as shown."""
    found = re.findall(
        r'^\| <span id="(\w+)">`\1`</span><br>`(\w+)`(?:<br>`[\w-]+`)? \| `([^`]*)`<br>',
        CONFIGURATION,
        re.M,
    )
    return {name: (default, env) for name, env, default in found}


def test_the_pages_keep_no_marker_unfilled() -> None:
    assert "<!-- generated" not in CONFIGURATION
    assert "<!-- generated" not in CLI


def test_every_setting_is_on_the_configuration_page_once_with_its_variable() -> None:
    table = _table()
    every = (
        set(WorkerSettings.model_fields)
        | set(ProducerSettings.model_fields)
        | set(WebSettings.model_fields)
    )
    assert set(table) == every, every ^ set(table)
    assert len(re.findall(r'<span id="', CONFIGURATION)) == len(every)
    for name, (_default, env) in table.items():
        assert env == "BATCHLINE_" + name.upper()


def test_the_configuration_pages_defaults_are_those_worker_help_shows() -> None:
    table = _table()
    done = run_cli("worker", "--help", env={"COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    shown = {
        m.group(1).replace("-", "_"): m.group(2)
        for m in re.finditer(r"^\s+--([\w-]+) \S+\s+.*default ([^\]]+)\]$", done.stdout, re.M)
    }
    assert set(WorkerSettings.model_fields) <= set(shown)
    for name in WorkerSettings.model_fields:
        assert table[name][0] == shown[name], (name, table[name][0], shown[name])
    assert "transformers-classify" in done.stdout
    assert "(secret)" not in done.stdout
    assert "``" not in done.stdout


def test_each_setting_carries_its_docstring_text() -> None:
    for cls in (WorkerSettings, ProducerSettings, WebSettings):
        for setting in HOOK.settings(cls):
            assert setting.doc, f"{setting.name} has no line in its class's Attributes:"
            assert HOOK._cell(setting.doc) in CONFIGURATION


def test_a_command_with_a_default_of_its_own_is_named_in_the_settings_text() -> None:
    """The page shows each setting's class default; a command that has a default of its own
    (status, usage and keys try Redis once: ``redis_wait_s`` 0, not 30) is named in the
    setting's description, which the page shows beside that default."""
    table = _table()
    classes = (ServiceSettings, ProducerSettings, WebSettings, WorkerSettings)
    docs = {s.name: s.doc for cls in classes for s in HOOK.settings(cls)}
    own = set()
    for command in cli_reference():
        for option in command.options:
            name = (option.env or "").removeprefix("BATCHLINE_").lower()
            if name in table and option.default != table[name][0]:
                word = command.name.split()[1]  # batchline keys create: keys
                own.add((name, word))
                assert re.search(rf"\b{word}\b", docs[name]), (command.name, name, docs[name])
    assert {("redis_wait_s", w) for w in ("status", "usage", "keys")} <= own


@pytest.mark.parametrize("command", HOOK.commands(), ids=lambda c: c.name)
def test_every_option_of_every_command_is_on_the_cli_page(command: object) -> None:
    assert f"## `{command.name}`" in CLI  # type: ignore[attr-defined]
    for option in command.options:  # type: ignore[attr-defined]
        flags = ", ".join(f"`{f}`" for f in option.flags)
        assert f"| {flags} |" in CLI, option.flags
        assert HOOK._cell(option.help) in CLI


def test_the_cli_page_has_every_command_of_the_parser() -> None:
    names = [c.name for c in HOOK.commands()]
    assert names[0] == "batchline"
    assert {"batchline worker", "batchline status", "batchline acl", "batchline demo"} <= set(names)
