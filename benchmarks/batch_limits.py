"""The Batch API's bounds, measured: what large answers cost the batch driver and Redis, and
what a large upload costs the interactive routes.

One invocation starts its own redis-server (free loopback port, no persistence), one
``batchline worker`` process (batch 64, timeout_ms 0) serving :func:`model`, and the API
(``uvicorn batchline.contrib.fastapi:create_app --factory``, its own process, its batch
driver in a child process). :func:`model` sleeps ``FIXED_MS`` per call and answers each text
a vector of ``--dim`` float32 with every digit (a real model's, not 0.5): the figures measure
batchline's paths, not a model's arithmetic.

``--part outputs``: for each ``--sizes`` entry (``LINESxTEXTS``: lines of TEXTS texts of one
character each, the largest answer an input byte can ask for), one embeddings batch, float
encoding, from ``POST /v1/batches`` to its end (or ``--timeout-s``): the driver process's
peak resident memory (sampled every 20 ms), Redis's peak ``used_memory`` (sampled alike),
the input and output files' bytes, the lines answered and refused (the output caps), the
leases the driver lost (its log lines), and the time. The output files are deleted between
sizes.

``--part uploads``: ``--lanes`` interactive clients (each ``POST /v1/embeddings`` of one
text, then ``--think-ms``, in a loop) for as long as one upload of ``--upload-mb`` MB takes
(``POST /v1/files`` from another process, the official client's multipart body, with
``Content-Length``), and for as long again with no upload: their latency p50 / p99, and the
API process's resident memory before the upload and its peak during it (sampled every 20 ms:
an upload is read as it arrives, never held whole). Repeated ``--repeats`` times; the p99 of
every repeat pooled too.

Usage::

    python -m benchmarks.batch_limits --part outputs
    python -m benchmarks.batch_limits --part outputs --output-ratio 100000 \
        --sizes 150x100,300x100,600x100,1200x100,40x2048   # the output grows, unbounded
    python -m benchmarks.batch_limits --part uploads
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.batch_api import QUEUE, interactive, latencies, start_stack
from benchmarks.harness import (
    Procs,
    Samples,
    add_redis_server_flag,
    child_env,
    cpu_s,
    fmt,
    header,
    load,
    log,
    machine,
    percentile,
    ratio,
    redis_server,
    versions,
    watchdog,
)

FIXED_MS = 10.0
MIB = 1 << 20


def model(items: list[Any]) -> list[Any]:
    """One batch of embedding requests: ``FIXED_MS`` asleep, then a ``BENCH_DIM`` vector of
    float32 with full digits per text."""
    import os

    import numpy as np

    dim = int(os.environ.get("BENCH_DIM", "384"))
    time.sleep(FIXED_MS / 1000)
    out = []
    for item in items:
        rows = len(item) if isinstance(item, list) else 1
        out.append(np.full((rows, dim), 1 / 3, dtype=np.float32))
    return out


def start(procs: Procs, args: argparse.Namespace, api_settings: dict[str, str]) -> tuple[str, str]:
    """The redis-server, a worker serving :func:`model` and the API; their URLs."""
    spec = "benchmarks.batch_limits:model"
    return start_stack(procs, args.redis_server, spec, api_settings, {"BENCH_DIM": str(args.dim)})


# -- outputs -------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(x) for x in (task / "children").read_text().split()]
    return found


def driver_pid(api_pid: int) -> int:
    """The API's batch driver process."""
    for pid in _children(api_pid):
        if b"_driver_child" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("the API runs no batch driver process")


def rss(pid: int) -> int:
    """A process's resident memory now, in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Peaks:
    """The highest RSS of a process (the driver's, the API's) and Redis ``used_memory`` seen,
    sampled every 20 ms."""

    def __init__(self, pid: int, url: str) -> None:
        import redis

        self.pid, self.redis = pid, redis.Redis.from_url(url)
        self.rss = self.used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.rss = max(self.rss, rss(self.pid))
            self.used = max(self.used, int(self.redis.info("memory")["used_memory"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.redis.close()


def tiny_texts_file(lines: int, texts: int) -> bytes:
    """``lines`` embedding requests of ``texts`` one-character texts each."""
    out = []
    for i in range(lines):
        body = {"model": QUEUE, "input": ["a"] * texts, "encoding_format": "float"}
        line = {"custom_id": f"{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
        out.append(json.dumps(line).encode() + b"\n")
    return b"".join(out)


def one_size(
    http: Any, url: str, procs: Procs, lines: int, texts: int, timeout_s: float
) -> dict[str, Any]:
    """One batch of ``lines`` x ``texts``: its figures."""
    data = tiny_texts_file(lines, texts)
    upload = http.post(
        "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
    ).json()
    pid = driver_pid(procs.procs["api"].pid)
    lost_before = procs.log_tail("api", 10**9).count("lease was lost")
    peaks = Peaks(pid, url)
    body = {"input_file_id": upload["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    start = time.perf_counter()
    batch = http.post("/v1/batches", json=body).json()
    while time.perf_counter() - start < timeout_s:
        batch = http.get(f"/v1/batches/{batch['id']}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        time.sleep(0.1)
    elapsed = time.perf_counter() - start
    peaks.stop()
    out_bytes = err_bytes = 0
    codes: dict[str, int] = {}
    for name in ("output_file_id", "error_file_id"):
        if batch.get(name):
            meta = http.get(f"/v1/files/{batch[name]}").json()
            if name == "output_file_id":
                out_bytes = meta["bytes"]
            else:
                err_bytes = meta["bytes"]
                for line in http.get(f"/v1/files/{batch[name]}/content").text.splitlines():
                    error = json.loads(line)["error"] or {}
                    codes[error.get("code", "?")] = codes.get(error.get("code", "?"), 0) + 1
            http.delete(f"/v1/files/{batch[name]}")
    http.delete(f"/v1/files/{upload['id']}")
    counts = batch["request_counts"]
    return {
        "size": f"{lines} x {texts}",
        "in": len(data),
        "status": batch["status"],
        "answered": f"{counts['completed']}/{counts['total']}",
        "refused": ", ".join(f"{n} {c}" for c, n in sorted(codes.items())) or "none",
        "out": out_bytes,
        "err": err_bytes,
        "rss": peaks.rss,
        "redis": peaks.used,
        "lost": procs.log_tail("api", 10**9).count("lease was lost") - lost_before,
        "s": elapsed,
    }


def outputs(args: argparse.Namespace, procs: Procs) -> list[dict[str, Any]]:
    import httpx

    settings = {"BATCHLINE_BATCH_LEASE_S": str(args.lease_s)}
    if args.output_ratio is not None:
        settings["BATCHLINE_BATCH_MAX_OUTPUT_RATIO"] = str(args.output_ratio)
    url, base = start(procs, args, settings)
    rows = []
    with httpx.Client(base_url=base, timeout=600) as http:
        for size in args.sizes.split(","):
            lines, texts = (int(x) for x in size.split("x"))
            log(f"outputs: {lines} lines x {texts} texts")
            rows.append(one_size(http, url, procs, lines, texts, args.timeout_s))
            log(f"  {rows[-1]}")
    return rows


def report_outputs(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"- {args.dim}-dimension float32 vectors, float encoding; `batch_lease_s` "
        f"{args.lease_s:g}; `batch_max_output_ratio` "
        f"{'default' if args.output_ratio is None else f'{args.output_ratio:g}'}; each batch "
        f"given {args.timeout_s:g} s\n"
    )
    print(
        "| lines x texts | input | status | answered | refused | output | errors "
        "| driver peak RSS | Redis peak used_memory | leases lost | time |"
    )
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']} | {r['in'] / 1000:,.0f} KB | {r['status']} | {r['answered']} "
            f"| {r['refused']} | {r['out'] / 1e6:,.1f} MB | {r['err'] / 1e6:,.2f} MB "
            f"| {r['rss'] / MIB:,.0f} MiB | {r['redis'] / MIB:,.0f} MiB | {r['lost']} "
            f"| {r['s']:.1f} s |"
        )


# -- uploads -------------------------------------------------------------------------------

#: The uploading process: builds its file, says so with the file's lines and their size
#: (``ready LINES BYTES``), then uploads it when told (a line on its stdin) and prints the
#: seconds it took.
UPLOADER = """
import sys, time, httpx
base, size, chunked = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "chunked"
line = b'{"custom_id": "%09d", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": "%s"}}\\n'
text = b"a few words of a sentence to embed " * int(sys.argv[4])
lines = size // len(line % (0, text))
data = b"".join(line % (i, text) for i in range(lines))
head = (
    b'--b0undary\\r\\nContent-Disposition: form-data; name="purpose"\\r\\n\\r\\nbatch\\r\\n'
    b'--b0undary\\r\\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\\r\\n'
    b'Content-Type: application/jsonl\\r\\n\\r\\n'
)
body = head + data + b"\\r\\n--b0undary--\\r\\n"
headers = {"Content-Type": "multipart/form-data; boundary=b0undary"}
print("ready", lines, len(line % (0, text)), flush=True)
with httpx.Client(base_url=base, timeout=600) as http:
    while sys.stdin.readline():
        t = time.perf_counter()
        content = (body[i : i + 65536] for i in range(0, len(body), 65536)) if chunked else body
        r = http.post("/v1/files", content=content, headers=headers)
        r.raise_for_status()
        http.delete(f"/v1/files/{r.json()['id']}")
        print(time.perf_counter() - t, flush=True)
"""


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process's main thread (the API's event loop) and of its others."""
    threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    main = cpu_s(pid, pid)
    return main, sum(cpu_s(pid, t) for t in threads if t != pid)


async def uploads_repeat(
    base: str,
    url: str,
    uploader: subprocess.Popen[bytes],
    api_pid: int,
    args: argparse.Namespace,
    s: Samples,
    pooled: Samples,
) -> None:
    import httpx

    if uploader.stdin is None or uploader.stdout is None:
        raise RuntimeError("the uploader was started without its pipes")
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        rss0 = rss(api_pid)
        peaks = Peaks(api_pid, url)
        uploader.stdin.write(b"go\n")
        uploader.stdin.flush()
        done = loop.run_in_executor(None, uploader.stdout.readline)
        t0 = time.perf_counter()
        cpu0 = thread_cpu_s(api_pid)
        healthz = args.bystander == "healthz"
        during = await interactive(http, args.lanes, args.think_ms, done, healthz=healthz)
        took = float(await done)
        cpu1 = thread_cpu_s(api_pid)
        peaks.stop()
        idle = await interactive(
            http, args.lanes, args.think_ms, time.perf_counter() - t0, healthz=healthz
        )
    s.add("upload s", took)
    s.add("loop cpu", cpu1[0] - cpu0[0])
    s.add("other cpu", cpu1[1] - cpu0[1])
    s.add("rss before", rss0 / MIB)
    s.add("rss peak", peaks.rss / MIB)
    latencies(s, pooled, {"during": during, "idle": idle})
    log("upload repeat: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in s.rows.items()))


def uploads(args: argparse.Namespace, procs: Procs) -> tuple[Samples, Samples, str]:
    """The repeats' figures, every request's latency pooled, and the uploaded file's lines
    (``694,444 lines of 144 bytes``)."""
    url, base = start(procs, args, {})
    uploader = procs.spawn(
        "uploader",
        [
            sys.executable,
            "-c",
            UPLOADER,
            base,
            str(args.upload_mb * 1_000_000),
            args.body,
            str(args.text_repeat),
        ],
        env=child_env(),
        pipes=True,
    )
    said = uploader.stdout.readline().split() if uploader.stdout is not None else []
    if said[:1] != [b"ready"]:
        raise RuntimeError(f"the uploader did not start:\n{procs.log_tail('uploader')}")
    lines = f"{int(said[1]):,} lines of {int(said[2])} bytes"
    s, pooled = Samples(), Samples()
    asyncio.run(_warm(base))
    for _ in range(args.repeats):
        asyncio.run(uploads_repeat(base, url, uploader, procs.procs["api"].pid, args, s, pooled))
    return s, pooled, lines


async def _warm(base: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await interactive(http, 2, 20.0, 1.0)


def report_uploads(s: Samples, pooled: Samples, args: argparse.Namespace, lines: str) -> None:
    def row(name: str, key: str, digits: int = 0) -> str:
        return f"| {name} | {fmt(s.med(key), digits)} | {s.spread(key)} |"

    print(
        f"- one {args.upload_mb} MB upload at a time ({args.body}, {lines}; "
        f"{args.repeats} repeats: medians, range "
        f"in the last column); {args.lanes} interactive clients "
        f"({'GET /healthz' if args.bystander == 'healthz' else 'POST /v1/embeddings'}), "
        f"{args.think_ms:g} ms think time; the model {FIXED_MS:g} ms a call\n"
    )
    print("| figure | median | range |\n|---|---:|---|")
    print(row("upload time (s)", "upload s", 1))
    print(row("API CPU during the upload, its event loop's thread (s)", "loop cpu", 2))
    print(row("API CPU during the upload, its other threads (s)", "other cpu", 2))
    print(row("API resident memory before the upload (MiB)", "rss before"))
    print(row("**API peak resident memory during the upload (MiB)**", "rss peak"))
    print(row("interactive p50, idle (ms)", "p50 idle", 1))
    print(row("interactive p50, during the upload (ms)", "p50 during", 1))
    print(row("interactive p99, idle (ms)", "p99 idle", 1))
    print(row("interactive p99, during the upload (ms)", "p99 during", 1))
    print(row("**p99 during / idle**", "p99 ratio", 2))
    print(row("interactive requests measured, during the upload", "n during"))
    during, idle = percentile(pooled.rows["during"], 99), percentile(pooled.rows["idle"], 99)
    print(f"| interactive p99, repeats pooled, idle / during (ms) | {idle:.1f} / {during:.1f} | |")
    print(f"| **p99 during / idle, repeats pooled** | {fmt(ratio(during, idle), 2)} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["outputs", "uploads"], required=True)
    parser.add_argument("--dim", type=int, default=384, help="the model's vector size")
    parser.add_argument("--sizes", default="100x100,600x100,40x2048", help="LINESxTEXTS,...")
    parser.add_argument("--lease-s", type=float, default=10.0, help="the API's batch_lease_s")
    parser.add_argument(
        "--output-ratio", type=float, default=None, help="the API's batch_max_output_ratio"
    )
    parser.add_argument("--timeout-s", type=float, default=180.0, help="most time a batch gets")
    parser.add_argument("--upload-mb", type=int, default=100)
    parser.add_argument(
        "--body", choices=["sized", "chunked"], default="sized", help="the upload's framing"
    )
    parser.add_argument(
        "--line-words",
        type=int,
        default=56,
        dest="text_repeat",
        help="an uploaded line's text: this many times 7 words (56: lines of 2 KB)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=4, help="interactive clients")
    parser.add_argument(
        "--bystander",
        choices=["embeddings", "healthz"],
        default="embeddings",
        help="what the interactive clients ask: an embedding, or GET /healthz (no model)",
    )
    parser.add_argument("--think-ms", type=float, default=20.0)
    add_redis_server_flag(parser)
    args = parser.parse_args()
    before = load()
    logdir = Path(tempfile.mkdtemp(prefix="bench-batch-limits-"))
    procs = Procs(logdir)
    watchdog(3600, "benchmarks.batch_limits", procs.stop_all)
    try:
        if args.part == "outputs":
            rows = outputs(args, procs)
        else:
            s, pooled, lines = uploads(args, procs)
    finally:
        procs.stop_all()
        shutil.rmtree(logdir, ignore_errors=True)
    print(f"# Batch API bounds, {args.part}\n")
    print(header())
    print(f"- {machine(before, load())}")
    print(f"- {versions('redis', 'fastapi', 'uvicorn')}")
    print(f"- {redis_server(args.redis_server)}")
    if args.part == "outputs":
        report_outputs(rows, args)
    else:
        report_uploads(s, pooled, args, lines)


if __name__ == "__main__":
    main()
