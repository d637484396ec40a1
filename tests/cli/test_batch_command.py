"""``batchline batch``: a JSONL file through the web backend's Batch API, over uvicorn, to a
real worker (the fixtures of tests/contrib/batches/test_batches.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr

from batchline.cli import main

from tests.contrib.batches.test_batches import (  # fixtures, used here
    MakeApp,
    embedder,
    embedding_line,
    jsonl,
    make_app,
    serve,
)
from tests.contrib.test_fastapi import Serve
from tests.support.service import run_cli
from tests.support.web_models import vector

__all__ = ["embedder", "make_app", "serve"]


@pytest.mark.slow
def test_batch_runs_a_file_and_writes_its_output_and_errors(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,  # noqa: F811
    queue: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = str(serve(make_app()).base_url)
    file = tmp_path / "requests.jsonl"
    file.write_bytes(jsonl([embedding_line("a", "first", queue), b"not json"]))

    assert main(["batch", str(file), "--url", base, "--poll-s", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "2/2 lines (100%), 1 failed, completed" in out
    (answer,) = [
        json.loads(x) for x in (tmp_path / "requests.output.jsonl").read_text().splitlines()
    ]
    assert answer["custom_id"] == "a"
    assert answer["response"]["body"]["data"][0]["embedding"] == vector("first")
    (error,) = [
        json.loads(x) for x in (tmp_path / "requests.errors.jsonl").read_text().splitlines()
    ]
    assert error["error"]["code"] == "invalid_json_line"

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert main(["batch", str(empty), "--url", base, "--poll-s", "0.05"]) == 1
    assert "the batch ended failed: empty_file" in capsys.readouterr().err
    assert main(["batch", str(file), "--url", "http://127.0.0.1:9", "--poll-s", "0.05"]) == 1
    assert "ConnectError" in capsys.readouterr().err
    # As a command: its progress and its files, without httpx's line per request.
    done = run_cli("batch", str(file), "--url", base, "--poll-s", "0.05", timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert "HTTP Request" not in done.stdout + done.stderr, done.stderr
    assert "2/2 lines (100%), 1 failed, completed" in done.stdout


@pytest.mark.slow
def test_batch_sends_the_key_in_batchline_api_key(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,  # noqa: F811
    queue: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "a-static-key-" + queue
    base = str(serve(make_app(api_key=SecretStr(key))).base_url)
    file = tmp_path / "requests.jsonl"
    file.write_bytes(jsonl([embedding_line("a", "first", queue)]))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["batch", str(file), "--url", base, "--poll-s", "0.05"]) == 1
    assert "POST /v1/files: 401 You didn't provide an API key" in capsys.readouterr().err
    monkeypatch.setenv("BATCHLINE_API_KEY", key)
    assert main(["batch", str(file), "--url", base, "--poll-s", "0.05"]) == 0
    assert "1/1 lines (100%), 0 failed, completed" in capsys.readouterr().out
