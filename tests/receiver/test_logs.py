"""Structured logs carry the ids of the work at hand."""

from __future__ import annotations

import io
import json
import logging

from receiver.logs import JsonFormatter, bind


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
