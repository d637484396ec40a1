"""A typo on the command line is one line on stderr saying what is accepted, and exit status
2 (argparse's own), never a traceback: every command, every kind of input (URL, queue name,
model, device, numbers, files, choices), as a flag or as a ``BATCHLINE_*`` variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline.cli import cli_reference, main

from tests.support.service import run_cli

# (arguments, variables, what the line says is accepted)
BAD_INPUTS: list[tuple[list[str], dict[str, str], str]] = [
    ([], {}, "the following arguments are required: COMMAND"),
    (["serve"], {}, "invalid choice: 'serve' (choose from 'worker', 'status'"),
    (["--log-level", "LOUD", "status"], {}, "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR')"),
    (["--log-format", "xml", "status"], {}, "(choose from 'text', 'json')"),
    (["status", "--bogus"], {}, "unrecognized arguments: --bogus"),
    # The Redis URL: no scheme, another scheme, a port that is not one; as flag or variable.
    (["status", "--redis-url", "localhost:6390"], {}, "starts with redis://, rediss:// (TLS)"),
    (["worker", "--redis-url", "http://localhost:6390"], {}, "e.g. redis://localhost:6379/0"),
    (["acl", "--role", "admin"], {}, "(choose from 'producer', 'worker', 'both')"),
    (["status"], {"BATCHLINE_REDIS_URL": "localhost:6390"}, "BATCHLINE_REDIS_URL: a Redis URL"),
    (["demo"], {"BATCHLINE_REDIS_URL": "http://x:6390"}, "BATCHLINE_REDIS_URL: a Redis URL"),
    (["status", "--redis-url", "redis://localhost:port/0"], {}, "is not a valid Redis URL"),
    # Names and numbers.
    (["status", "--queue", "my queue"], {}, "letters, digits, '_', '.' or '-', got 'my queue'"),
    (["acl", "--prefix", "a/b"], {}, "--prefix: name must be 1-128 characters"),
    (["status", "--priorities", "0"], {}, "--priorities: Input should be greater than or equal"),
    (["worker", "--batch-size", "many"], {}, "--batch-size: Input should be a valid integer"),
    (["worker"], {"BATCHLINE_BATCH_SIZE": "0"}, "BATCHLINE_BATCH_SIZE: Input should be greater"),
    (["worker"], {"BATCHLINE_BACTH_SIZE": "8"}, "unknown setting(s) BATCHLINE_BACTH_SIZE; known"),
    (["worker", "--dtype", "float8"], {}, "'auto', 'float32', 'float16' or 'bfloat16'"),
    (["worker", "--check", "--max-age-s", "-1"], {}, "--max-age-s: must be above 0"),
    # The model: its kind, a local path that is not there, its device, its options.
    (["worker", "--model", "bert"], {}, "model must be sentence-transformers, transformers"),
    (["worker", "--model-path", "/no/such/model"], {}, "a model_path is a local directory"),
    (["worker", "--model", "generate", "--model-path", "./no.gguf"], {}, "a .gguf file"),
    (["worker", "--device", "gpu"], {}, "device must be auto, cpu, cuda, cuda:N"),
    (["worker", "--calibration", "texts.txt"], {}, "for backend openvino-int8 only"),
    (["worker", "--adapters", "a=/x"], {}, "adapters and adapter_dir are for the generate"),
    (["worker", "--model", "generate", "--adapters", "a"], {}, "'a' is not NAME=PATH"),
    (["worker", "--model", "generate"], {"BATCHLINE_ADAPTERS": "a=/x,a=/y"}, "'a' is named twice"),
    # The demo's options.
    (["demo", "--requests", "-5"], {}, "--requests: must be above 0, got '-5'"),
    (["demo", "--step-s", "0"], {}, "--step-s: must be above 0"),
    (["demo", "--in-process", "--threads", "none"], {}, "--threads: must be an integer above 0"),
    (["demo", "--plot", "load.txt"], {}, "--plot takes a .png, .pdf, .svg"),
    (["demo", "--plot", "no/such/dir/load.png"], {}, "in a directory that exists"),
    (["demo", "--generate", "--model-path", "./nothing"], {}, "a model_path is a local"),
    (["demo", "--generate", "--in-process"], {}, "demo takes --generate or --in-process"),
    # Usage: its days and tenant.
    (["usage", "--day", "2026-01-31"], {}, "a day is YYYYMMDD (UTC), got '2026-01-31'"),
    (["usage", "--from", "20260201", "--to", "20260101"], {}, "ends (20260101) before it"),
    (["usage", "--from", "20200101", "--to", "20260101"], {}, "at most 731 days at once"),
    (["usage", "--tenant", "acme.eu"], {}, "got 'acme.eu'"),
    (["usage", "--queue", "my queue"], {}, "got 'my queue'"),
    # The Batch API's client.
    (["batch", "no-such-file.jsonl"], {}, "no-such-file.jsonl: no such file"),
    (["batch", "FILE", "--url", "localhost:8000"], {}, "--url is the web backend's http://"),
    (["batch", "FILE", "--poll-s", "0"], {}, "--poll-s: must be above 0"),
    (["batch", "FILE", "--endpoint", "/v1/chat"], {}, "(choose from '/v1/embeddings'"),
    # The API's keys.
    (["keys"], {}, "the following arguments are required: KEYS_COMMAND"),
    (["keys", "create"], {}, "the following arguments are required: --tenant"),
    (["keys", "create", "--tenant", "a.b"], {}, "--tenant: a tenant must be 1-64 characters"),
    (["keys", "create", "--tenant", "a", "--weight", "0"], {}, "--weight: weight must be in"),
    (["keys", "create", "--tenant", "a", "--max-in-flight", "x"], {}, "invalid int value: 'x'"),
    (["keys", "create", "--tenant", "a", "--over-quota", "wait"], {}, "'refuse', 'idle'"),
    (["keys", "list", "--prefix", "a b"], {}, "--prefix: name must be 1-128 characters"),
    (["keys", "revoke", "KEY"], {}, "a key id is 8 hex digits (keys list shows them), got 'KEY'"),
    (["keys", "rotate", "0123abcd", "--grace-s", "-1"], {}, "--grace-s: must be >= 0"),
    (["keys", "set", "--tenant", "a"], {}, "give at least one of --weight"),
    (["keys", "set", "--tenant", "a", "--requests-per-min", "-1"], {}, "requests_per_min must"),
]


@pytest.mark.parametrize(
    ("args", "env", "says"), BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _, _ in BAD_INPUTS]
)
def test_a_bad_input_is_one_line_naming_what_is_accepted(
    args: list[str],
    env: dict[str, str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text('{"custom_id": "a"}\n')
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        status = main(args)
    except SystemExit as exc:  # the parser's own errors
        status = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("batchline"), err
    assert says in err, err


def _words(args: list[str], n: int) -> list[str]:
    """Each run of ``n`` arguments, joined (a command of two words: ``keys create``)."""
    return [" ".join(args[i : i + n]) for i in range(len(args) - n + 1)]


def test_the_table_walks_every_command_of_the_parser() -> None:
    """A command added to batchline/cli/ gets its bad inputs in the table above."""
    commands = {c.name.removeprefix("batchline").strip() for c in cli_reference()} - {""}
    walked = {
        next((name for n in (2, 1) for name in _words(args, n) if name in commands), "")
        for args, _, _ in BAD_INPUTS
    }
    assert commands - walked == set()
    assert len(commands) >= 5, commands


def test_the_variables_that_are_not_settings_are_no_typo(
    redis_url: str, queue: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/setup.sh's own variables (exported in CI or a Dockerfile, say), tracing's and
    the model cache's stop no command."""
    for name, value in [
        ("BATCHLINE_EXTRAS", "redis,service"),
        ("BATCHLINE_TORCH_INDEX", "default"),
        ("BATCHLINE_OTEL", "0"),
        ("BATCHLINE_CACHE_DIR", str(Path.home() / ".cache" / "batchline")),
    ]:
        monkeypatch.setenv(name, value)
    assert main(["status", "--redis-url", redis_url, "--queue", queue]) == 0
    assert capsys.readouterr().err == ""


def test_no_url_a_typo_shows_holds_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--redis-url", "http://user:s3cret@localhost:6390/0"]) == 2
    err = capsys.readouterr().err
    assert "s3cret" not in err
    assert "http://user:***@localhost:6390/0" in err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "worker"])
def test_a_url_without_its_scheme_is_one_line_from_the_command(command: str) -> None:
    done = run_cli(command, "--redis-url", "localhost:6390", timeout_s=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("batchline: invalid settings: --redis-url: a Redis URL starts with")


@pytest.mark.slow
def test_a_model_that_does_not_load_is_one_line_and_status_1(redis_url: str) -> None:
    """Seen only once it loads (after Redis answers): the command says which model, from
    where, on which device, and what went wrong."""
    done = run_cli(
        "worker", "--redis-url", redis_url, "--model", "no_such_module_here:fn", timeout_s=120
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "batchline: the model did not load (model no_such_module_here:fn, model_path its "
        "default, device auto): ModuleNotFoundError: No module named 'no_such_module_here'"
    )
