"""The Batch API's pure parts: input lines, file checks, statuses, answers, and the
streaming multipart reader, without a server."""

from __future__ import annotations

import json

import pytest

from batchline.contrib.batches._lines import (
    FINAL,
    MAX_FILE_LINES,
    FileScan,
    LineError,
    error_line,
    file_errors,
    moves,
    output_line,
    parse_line,
    request_id,
)
from batchline.contrib.batches._multipart import (
    END,
    MultipartError,
    MultipartReader,
    PartStart,
    boundary,
)
from batchline.keys import is_name

EMB = "/v1/embeddings"


def line(**fields: object) -> str:
    base = {"custom_id": "a", "method": "POST", "url": EMB, "body": {"model": "m", "input": "x"}}
    return json.dumps({**base, **fields})


def test_a_line_is_read_for_its_endpoint() -> None:
    got = parse_line(line(), EMB)
    assert (got.custom_id, got.url, got.body) == ("a", EMB, {"model": "m", "input": "x"})


@pytest.mark.parametrize(
    ("raw", "code", "custom_id"),
    [
        ('{"custom_id": "a"', "invalid_json_line", None),
        ("[1, 2]", "invalid_json_line", None),
        (line(custom_id=""), "missing_required_parameter", None),
        (line(custom_id=5), "missing_required_parameter", None),
        (line(method="GET"), "invalid_method", "a"),
        (line(url="/v1/moderations"), "invalid_url", "a"),
        (line(url="/v1/completions"), "mismatched_endpoint", "a"),
        (line(body="text"), "invalid_request", "a"),
        (line(custom_id="\ud800"), "invalid_custom_id", "\ud800"),  # a lone surrogate
    ],
)
def test_a_bad_line_is_that_lines_error(raw: str, code: str, custom_id: str | None) -> None:
    with pytest.raises(LineError) as caught:
        parse_line(raw, EMB)
    assert (caught.value.code, caught.value.custom_id) == (code, custom_id)


@pytest.mark.parametrize("depth", [65, 50_000])
def test_a_line_nested_too_deep_is_its_own_invalid_json_line(depth: int) -> None:
    deep = line(body={"model": "m", "input": "x"}).replace('"x"', "[" * depth + "]" * depth)
    with pytest.raises(LineError) as caught:
        parse_line(deep, EMB)
    assert (caught.value.code, caught.value.custom_id) == ("invalid_json_line", None)
    assert "MAX_JSON_DEPTH=64" in caught.value.message
    scan = FileScan()  # uploading it counts it: its error comes when a batch runs it
    for raw in (line(custom_id="a"), deep, line(custom_id="b")):
        scan.add(raw.encode())
    assert (scan.lines, scan.duplicate) == (3, None)
    at_limit = line(body={"model": "m", "input": "x"}).replace('"x"', "[" * 62 + "]" * 62)
    assert parse_line(at_limit, EMB).body["input"] == json.loads("[" * 62 + "]" * 62)


def test_request_ids_are_names_and_depend_on_file_endpoint_and_custom_id() -> None:
    rid = request_id("file-abc", EMB, "line one / ü")
    assert is_name(rid)
    assert rid == request_id("file-abc", EMB, "line one / ü")
    assert rid != request_id("file-abd", EMB, "line one / ü")
    assert rid != request_id("file-abc", "/v1/completions", "line one / ü")
    assert rid != request_id("file-abc", EMB, "line two")


def test_a_scan_counts_lines_and_finds_the_first_repeated_custom_id() -> None:
    scan = FileScan()
    for raw in (line(custom_id="a"), "not json", line(custom_id="b"), line(custom_id="a")):
        scan.add(raw.encode())
    scan.add(line(custom_id="b").encode())
    assert (scan.lines, scan.duplicate) == (5, "a")


def test_file_errors_are_openais_validation() -> None:
    assert file_errors(3, None) == []
    assert file_errors(0, None)[0]["code"] == "empty_file"
    assert file_errors(MAX_FILE_LINES + 1, None)[0]["code"] == "too_many_requests"
    assert file_errors(MAX_FILE_LINES, "x")[0]["code"] == "duplicate_custom_id"


def test_statuses_move_as_openais() -> None:
    assert moves("validating", "in_progress")
    assert moves("in_progress", "finalizing")
    assert moves("in_progress", "cancelling")
    assert moves("cancelling", "cancelled")
    assert not moves("completed", "cancelling")
    assert not moves("cancelled", "in_progress")
    assert {"failed", "completed", "expired", "cancelled"} == FINAL


def test_answers_are_openais_batch_output_lines() -> None:
    ok = json.loads(output_line("a", "r1", 200, {"object": "list"}))
    assert ok == {
        "id": "batch_req_r1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "r1", "body": {"object": "list"}},
        "error": None,
    }
    failed = json.loads(error_line("b", "r2", "cancelled", "no"))
    assert failed["response"] is None
    assert failed["error"] == {"code": "cancelled", "message": "no"}


BODY = (
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="purpose"\r\n\r\n'
    b"batch\r\n"
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
    b"Content-Type: application/octet-stream\r\n\r\n"
    b"line one\r\nline two\n\r\n"
    b"--XyZ--\r\n"
)


def read(chunks: list[bytes]) -> list[object]:
    reader = MultipartReader(b"XyZ")
    found: list[object] = []
    for chunk in chunks:
        found += reader.feed(chunk)
    reader.close()
    merged: list[object] = []
    for item in found:  # a part's pieces, joined
        if isinstance(item, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(BODY)])
def test_the_multipart_reader_reads_a_body_cut_anywhere(size: int) -> None:
    chunks = [BODY[i : i + size] for i in range(0, len(BODY), size)]
    assert read(chunks) == [
        PartStart("purpose", None),
        b"batch",
        PartStart("file", "in.jsonl"),
        b"line one\r\nline two\n",
        END,
    ]


def test_the_multipart_reader_refuses_a_body_cut_short() -> None:
    with pytest.raises(MultipartError):
        read([BODY[:-12]])
    with pytest.raises(MultipartError):
        boundary("application/json")
    assert boundary('multipart/form-data; boundary="a b"') == b"a b"
