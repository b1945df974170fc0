"""Structured logs carry the ids of the work at hand."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator

import pytest

from receiver.logs import JsonFormatter, bind, configure_logging


def test_json_lines_carry_bound_ids_and_extras() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("nopoll.test.logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with bind(provider="sim", response_id="resp_1", event_id="msg_1", batch_id=None):
            log.info("fetched %s", "resp_1", extra={"status": 200})
            with bind(sink="db"):
                log.warning("sink failed")
        log.info("outside")
    finally:
        log.removeHandler(handler)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "fetched resp_1" and first["level"] == "info"
    assert (first["provider"], first["response_id"], first["event_id"]) == (
        "sim",
        "resp_1",
        "msg_1",
    )
    assert first["status"] == 200 and "batch_id" not in first
    assert second["sink"] == "db" and second["response_id"] == "resp_1"
    assert "response_id" not in third and third["logger"] == "nopoll.test.logs"


@pytest.fixture
def text_logs(
    capsys: pytest.CaptureFixture[str],
) -> Iterator[Callable[[], Callable[[], list[str]]]]:
    """Factory: set up ``log_format: text`` on stderr as ``nopoll serve`` does (called in the
    test itself, where stderr is the captured one) and get a reader of the lines written;
    the loggers it touches are restored afterwards."""
    root = logging.getLogger()
    touched = [logging.getLogger(n) for n in ("httpx", "arq.worker", "uvicorn", "uvicorn.error")]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in [root, *touched]]

    def start() -> Callable[[], list[str]]:
        configure_logging("info", "text")
        return lambda: capsys.readouterr().err.splitlines()

    try:
        yield start
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


FORGED = "2026-11-29 10:00:00,000 ERROR nopoll.worker batch lost"


def test_text_logs_cannot_be_forged_by_a_custom_id(text_logs) -> None:
    """A custom_id (provider data) with a newline, a carriage return or terminal escapes
    stays on its record's line, in the message and in the bound fields alike."""
    custom_id = f"row-1\n{FORGED}\r\x1b[2K\u2028\x85"
    read = text_logs()
    log = logging.getLogger("nopoll.test.text")
    with bind(provider="sim", key=f"batch_1/{custom_id}", custom_id="a b=c"):
        log.warning("row %s failed", custom_id)
        try:
            raise ValueError(f"bad row {custom_id}")
        except ValueError:
            log.exception("giving up on %s", custom_id)
    lines = read()
    records = [line for line in lines if not line.startswith("  ")]
    assert len(records) == 2, lines  # a traceback's lines are indented, never a record
    assert not any(line.startswith(FORGED) for line in lines)
    first = records[0]
    assert "WARNING nopoll.test.text row row-1\\n2026-11-29" in first
    assert "\\r\\u001b[2K\\u2028\\u0085" in first
    assert "key=batch_1/row-1\\n2026-11-29" not in first  # a value with spaces is quoted
    assert 'key="batch_1/row-1\\n2026-11-29 10:00:00,000 ERROR' in first
    assert 'custom_id="a b=c"' in first and "provider=sim" in first
    assert records[1].endswith('custom_id="a b=c"') and "giving up on row-1\\n" in records[1]
    assert any(line.startswith("  ValueError: bad row row-1") for line in lines)


def test_text_logs_escape_backslashes_so_escapes_are_unambiguous(text_logs) -> None:
    read = text_logs()
    logging.getLogger("nopoll.test.text").warning("a\\nb vs %s", "a\nb")
    (line,) = read()
    assert line.endswith("a\\\\nb vs a\\nb")
