"""The pure parts of ``nopoll submit``: a line's create body, its idempotency key, and a
batch file's checks and rows per dialect."""

from __future__ import annotations

import orjson
import pytest

from receiver.providers.openai import OpenAIDialect
from receiver.submit.batch import build_batch
from receiver.submit.creates import create_body, idempotency_key, provider_reason, transient


def test_a_line_becomes_a_background_create_with_custom_id_in_metadata():
    body, custom_id, error = create_body(
        b'{"model": "m", "input": "hi", "custom_id": "c1", "metadata": {"team": "a"}}'
    )
    assert error is None and custom_id == "c1"
    assert body == {
        "model": "m",
        "input": "hi",
        "metadata": {"team": "a", "custom_id": "c1"},
        "background": True,
    }


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"{nope", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"input": "x"}', "model: must be a non-empty string"),
        (b'{"model": "m", "custom_id": 7}', "custom_id: must be a non-empty string"),
        (b'{"model": "m", "metadata": []}', "metadata: must be an object"),
    ],
)
def test_a_line_that_is_no_create_body_says_why(line, error):
    body, _, why = create_body(line)
    assert body is None and why is not None and why.startswith(error)


def test_keys_are_stable_and_differ_by_provider_file_and_line():
    key = idempotency_key("sail", "d" * 64, "line:1")
    assert key == idempotency_key("sail", "d" * 64, "line:1")
    others = {
        idempotency_key("valar", "d" * 64, "line:1"),
        idempotency_key("sail", "e" * 64, "line:1"),
        idempotency_key("sail", "d" * 64, "line:2"),
    }
    assert key not in others and len(others) == 3
    assert key.startswith("nopoll-") and len(key) <= 64


def test_the_providers_own_reason_is_kept():
    assert provider_reason(400, b'{"error": {"message": "bad model"}}') == "bad model"
    assert provider_reason(400, b'{"error": "flat"}') == "flat"
    assert provider_reason(502, b"<html>") == "HTTP 502"
    # sference's (Litestar's) error body: the detail and what extra says of each field
    sference = (
        b'{"status_code": 400, "detail": "Validation failed for POST /v1/batches",'
        b' "extra": [{"message": "Expected 24h", "key": "window", "source": "body"}]}'
    )
    assert provider_reason(400, sference) == (
        "Validation failed for POST /v1/batches; window: Expected 24h"
    )
    assert provider_reason(404, b'{"status_code": 404, "detail": "Not Found"}') == "Not Found"
    valar = b'{"error": {"type": "rate_limit_exceeded", "message": "slow down"}}'
    assert provider_reason(429, valar) == "slow down"


def _line(i, model="m", url="/v1/responses"):
    return i, orjson.dumps(
        {"custom_id": f"c{i}", "method": "POST", "url": url, "body": {"model": model, "input": "x"}}
    )


@pytest.mark.parametrize("dialect", ["sference", "sail", "valar"])
def test_inline_dialects_get_their_own_row_shape(dialect):
    built = build_batch([_line(1), _line(2)], dialect)
    assert not built.rejected and built.rows == 2
    rows = orjson.loads(b"[" + bytes(built.requests) + b"]")
    part = "body" if dialect == "sference" else "params"
    assert rows[0] == {"custom_id": "c1", part: {"model": "m", "input": "x"}}


def test_openai_keeps_the_lines_as_a_file():
    built = build_batch([_line(1), _line(2)], "openai")
    lines = bytes(built.file).splitlines()
    assert [orjson.loads(x)["custom_id"] for x in lines] == ["c1", "c2"]
    assert built.endpoint == "/v1/responses" and built.model == "m"


def test_every_bad_line_is_listed_and_the_row_limit_holds():
    built = build_batch([_line(1), _line(1), _line(2, model="other"), _line(3, url="/x")], "sail")
    assert [(r.line, r.error.split(":")[0]) for r in built.rejected] == [
        (1, "custom_id"),
        (2, "body.model"),
        (3, "url"),
    ]
    many = build_batch((_line(i) for i in range(OpenAIDialect.row_limit + 1)), "openai")
    assert "takes at most 50,000 per batch" in many.rejected[0].error


def test_the_statuses_a_create_is_retried_on() -> None:
    # the "not now" 4xx every caller shares, 409 (the key is still busy), every 5xx but 501
    retried = [s for s in range(100, 600) if transient(s)]
    assert retried == [408, 409, 425, 429, 500, *range(502, 600)]
    assert not transient(None)


def _row(custom_id="c1", url="/v1/responses", **body):
    body = {"model": "m", "input": "x", **body}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("dialect", ["sail", "valar"])
def test_lines_sail_and_valar_would_refuse_are_listed_with_the_rule(dialect):
    lines = [
        _row("ok-1_a"),
        _row("Upper"),
        _row("has space"),
        _row("_leading"),
        _row("x" * 65),
        _row("chat", url="/v1/chat/completions"),
        _row("meta", metadata={"n": 1}),
        _row("asap", metadata={"completion_window": "asap"}),
        _row("flex", metadata={"completion_window": "flex"}),
    ]
    built = build_batch(list(enumerate(lines, start=1)), dialect)
    refused = {r.line: r.error for r in built.rejected}
    assert sorted(refused) == [2, 3, 4, 5, 6, 7, 8]
    for line in (2, 3, 4, 5):
        assert "does not match ^[a-z0-9][a-z0-9_-]*$" in refused[line]
    assert refused[6].startswith("url: /v1/chat/completions, but")
    [alone] = build_batch([(1, _row("chat", url="/v1/chat/completions"))], dialect).rejected
    assert alone.error == "url: /v1/chat/completions, but batches here take /v1/responses only"
    assert refused[7] == "body.metadata.n: must be a string"
    assert refused[8] == "body.metadata.completion_window: asap is not available for batches"


def test_sference_rows_need_messages_or_input_and_no_background():
    lines = [
        _row("a"),
        orjson.dumps(
            {
                "custom_id": "b",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"model": "m", "messages": []},
            }
        ),
        _row("c", background=True),
        orjson.dumps(
            {"custom_id": "d", "method": "POST", "url": "/v1/responses", "body": {"model": "m"}}
        ),
    ]
    built = build_batch(list(enumerate(lines, start=1)), "sference")
    assert [(r.line, r.error) for r in built.rejected] == [
        (2, "body: needs a non-empty messages list or a Responses input"),
        (3, "body.background: not supported in sference batch rows"),
        (4, "body: needs a non-empty messages list or a Responses input"),
    ]


@pytest.mark.parametrize(
    "name",
    ["reviews.jsonl", "my batch (v2).jsonl", "é" * 10, "x" * 300, ""],
)
def test_the_batch_label_fits_sails_and_valars_pattern(name):
    import re

    from receiver.providers.base import batch_label

    label = batch_label(name, "0123456789abcdef" * 4)
    assert re.fullmatch(r"[a-zA-Z0-9_-]+", label) and len(label) <= 128
    assert label.startswith("nopoll-") and label.endswith("-0123456789ab")
