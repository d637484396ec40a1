"""The code blocks of README.md and of every page of docs/, found by Sybil and run in the
order of their page, as a user copying them into a fresh shell and a Python prompt would.

A Python block runs in a fresh namespace, as a program of its own that a reader copies,
unless it says it continues the page's previous Python block (``<!-- continues: previous
block -->``): then it runs in that block's namespace. A shell block runs in ``bash -e -o
pipefail``, in a directory of its own per page, and what it leaves running in the
background (``batchline worker ... &``) runs until the page is done, then gets SIGTERM
(SIGKILL 30 s later). Each page's Redis and web API are its own: the pages use port 6390
for Redis and 8000 for the API, which a run replaces with free loopback ports, so that a
page starts its own ``redis-server`` as it tells the reader to.

Markers, HTML comments on the lines just before a block (invisible on the site):

- ``<!-- not run: REASON -->``: the block is not run, and REASON says why;
- ``<!-- run by: tests/PATH.py::TEST -->``: that test runs the block (it must exist);
- ``<!-- then wait for: URL -->``: after the block, wait until URL answers 200 (a server
  the block started in the background);
- ``<!-- continues: previous block -->``: a Python block that uses what the page's previous
  Python block defined (run in its namespace; tests/docs/test_code_blocks.py checks that
  every other block uses no name it does not define);

and anywhere on a page, ``<!-- needs: MODULE ... -->``: the page is skipped, naming the
missing module, where one is not installed (the extras; all of them in CI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from tests.support.service import REPO, _free_port, _redis_server_binary, subprocess_env

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
#: Languages of blocks that are shown, not run: output, configuration, other languages.
SHOWN = {"text", "yaml", "json", "lua", "acl", "toml", "ini", "http"}

#: The ports the pages use, replaced by free ones in each run of a page.
PAGE_PORTS = (6390, 8000)
_PORTS = "|".join(map(str, PAGE_PORTS))
_PORT = re.compile(rf"(localhost:|127\.0\.0\.1:|--port[ =]|-p )({_PORTS})\b")
_MARKER = re.compile(
    r"^[ \t]*<!--\s*(not run|run by|then wait for|continues):\s*(.*?)\s*-->[ \t]*$"
)
#: What a ``continues`` marker says: the page's previous Python block.
CONTINUES = "previous block"
_NEEDS = re.compile(r"<!--\s*needs:\s*(.*?)\s*-->")
_INFO = re.compile(r"(?P<info>[^\n]*)$\n", re.M)

SHELL_TIMEOUT_S = 300.0
WAIT_TIMEOUT_S = 120.0


def pages() -> list[Path]:
    """README.md and every page of the site, in a stable order."""
    site = sorted(p for p in (REPO / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [REPO / "README.md", *site]


@dataclasses.dataclass
class Block:
    """One fenced block: its language, source, line and the markers just before it."""

    language: str
    source: str
    line: int
    markers: dict[str, str]

    @property
    def kind(self) -> str:
        """``python``, ``shell``, or ``shown`` (any other language)."""
        if self.language in PYTHON:
            return "python"
        if self.language in SHELL:
            return "shell"
        return "shown"


def _markers_before(text: str, start: int) -> dict[str, str]:
    markers: dict[str, str] = {}
    lines = text[:start].splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    while lines and (found := _MARKER.match(lines[-1])):
        markers[found.group(1)] = found.group(2)
        lines.pop()
    return markers


def blocks(document: Document) -> Iterator[Region]:
    """Sybil's parser: every fenced block of the page, as a region holding a Block."""
    for region in RawFencedCodeBlockLexer(info_pattern=_INFO)(document):
        info = region.lexemes["info"].strip()
        block = Block(
            language=info.split()[0] if info else "",
            source=str(region.lexemes["source"]),
            line=document.text.count("\n", 0, region.start) + 1,
            markers=_markers_before(document.text, region.start),
        )
        yield Region(region.start, region.end, parsed=block, evaluator=_evaluate)


def parse(path: Path) -> Document:
    return Document.parse(str(path), blocks)


def needs(path: Path) -> list[str]:
    """The modules a page says it needs (``<!-- needs: ... -->``)."""
    text = path.read_text(encoding="utf-8")
    return [name for found in _NEEDS.finditer(text) for name in found.group(1).split()]


class PageRun:
    """What one run of a page holds: its ports, its directory, its background processes."""

    def __init__(self, path: Path, workdir: Path) -> None:
        self.path = path
        self.workdir = workdir
        self.ports = {port: _free_port() for port in PAGE_PORTS}
        self.shells: list[subprocess.Popen[bytes]] = []
        self.log = workdir / "shell.log"
        self.namespace: dict[str, Any] | None = None  # the previous Python block's
        self.env = subprocess_env()
        bindir = workdir / "bin"
        bindir.mkdir()
        # The commands a reader runs: the redis-server the service tests use (the newest
        # found), and this interpreter's console scripts (batchline, uvicorn).
        binary = _redis_server_binary()
        if binary is not None:
            (bindir / "redis-server").symlink_to(binary)
        paths = [str(bindir), sysconfig.get_path("scripts"), self.env.get("PATH", "")]
        self.env["PATH"] = os.pathsep.join(paths)

    def localize(self, source: str) -> str:
        """The block with this run's ports in place of the page's."""
        return _PORT.sub(lambda m: m.group(1) + str(self.ports[int(m.group(2))]), source)

    def where(self, block: Block) -> str:
        return f"{self.path.relative_to(REPO)}:{block.line}"

    def run_python(self, block: Block) -> None:
        """The block as a program of its own, or in the namespace of the block it says it
        continues."""
        if "continues" in block.markers:
            if self.namespace is None:
                raise AssertionError(f"{self.where(block)}: continues no Python block run")
            namespace = self.namespace
        else:
            namespace = {"__name__": "__main__"}
        code = compile(self.localize(block.source), self.where(block), "exec")
        exec(code, namespace)  # noqa: S102
        self.namespace = namespace

    def run_shell(self, block: Block) -> None:
        done = self.workdir / f"done-{block.line}"
        # The block's foreground part ends with the done file; bash then waits for what the
        # block left in the background (ignoring the SIGTERM that ends the page's run), so
        # that those processes stay its children until they exit.
        script = f"{self.localize(block.source)}\ntouch {done}\ntrap '' TERM\nwait\n"
        with open(self.log, "ab") as log:
            log.write(f"\n$ # {self.where(block)}\n{block.source}".encode())
            log.flush()
            shell = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", script],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.shells.append(shell)
        deadline = time.monotonic() + SHELL_TIMEOUT_S
        while not done.exists():
            if shell.poll() is not None:
                raise AssertionError(
                    f"{self.where(block)}: the block exited {shell.returncode}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.where(block)}: still running after {SHELL_TIMEOUT_S} s"
                )
            time.sleep(0.05)

    def wait_for(self, block: Block, url: str) -> None:
        url = self.localize(url)
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.where(block)}: {url} did not answer:\n{self.output()}")
            if self.shells and self.shells[-1].poll() is not None:
                raise AssertionError(f"{self.where(block)}: its server exited:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        """Stop what the page's shell blocks left running: SIGTERM (workers drain), then
        SIGKILL after 30 s; and the page's Redis, which daemonized out of their reach."""
        for shell in self.shells:
            _signal_group(shell.pid, signal.SIGTERM)
        for shell in self.shells:
            try:
                shell.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(shell.pid, signal.SIGKILL)
                shell.wait(30)
        _shutdown_redis(self.ports[6390])


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _shutdown_redis(port: int) -> None:
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=1)
    try:
        client.shutdown(nosave=True)
    except (redis.ConnectionError, redis.ResponseError):
        pass  # not started by the page, or gone already
    finally:
        client.close()


#: The page run in progress (one page at a time: a test runs a page from start to end).
_CURRENT: list[PageRun] = []


def _evaluate(example: Example) -> str | None:
    block: Block = example.parsed
    run = _CURRENT[-1]
    if "not run" in block.markers or "run by" in block.markers or block.kind == "shown":
        if block.kind == "python":
            run.namespace = None  # a block after it cannot continue it here
        return None
    if block.kind == "python":
        run.run_python(block)
    else:
        run.run_shell(block)
    if "then wait for" in block.markers:
        run.wait_for(block, block.markers["then wait for"])
    return None


def run_page(path: Path, workdir: Path) -> None:
    """Run every block of the page in order, then stop what its blocks left running. What
    the shell blocks printed goes to stderr, which pytest shows where the page fails."""
    run = PageRun(path, workdir)
    _CURRENT.append(run)
    try:
        for example in parse(path):
            example.evaluate()
    finally:
        _CURRENT.pop()
        run.close()
        sys.stderr.write(run.output())
