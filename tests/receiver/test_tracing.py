"""receiver.tracing: off, it adds nothing to a job; on, a callback's job carries its trace."""

from __future__ import annotations

import subprocess
import sys

from nopoll.kinds import KINDS
from receiver import tracing
from receiver.providers.base import Callback
from receiver.queue.jobs import FetchBatch, FetchResponse
from receiver.webhooks.endpoint import _job
from tests.traces import in_memory_traces, named, traceparent_of


def test_off_no_traceparent_in_the_job_kwargs() -> None:
    assert not tracing.enabled()
    assert tracing.traceparent() is None
    with tracing.span("anything") as current:
        assert current is None
    for event in ("response.completed", "batch.completed"):
        job = _job("sim", "msg_1", Callback(event, KINDS[event.split(".")[0]], "obj_1"))
        assert "traceparent" not in job.kwargs
    retry = FetchResponse.from_kwargs(
        _job("sim", "msg_1", Callback("response.completed", KINDS["response"], "r")).kwargs
    )
    assert "traceparent" not in retry.to_kwargs()


def test_on_the_job_carries_the_current_span_and_round_trips() -> None:
    with in_memory_traces() as spans:
        with tracing.span("webhook", kind="server"):
            job = _job("sim", "msg_1", Callback("batch.completed", KINDS["batch"], "batch_1"))
        [webhook] = named(spans, "webhook")
        assert job.kwargs["traceparent"] == traceparent_of(webhook)
        again = FetchBatch.from_kwargs(job.kwargs)
        assert again.traceparent == job.kwargs["traceparent"]
        assert again.to_kwargs()["traceparent"] == job.kwargs["traceparent"]
        assert "traceparent" not in again.runner_kwargs()
        with tracing.span("fetch_batch", parent=again.traceparent, kind="consumer"):
            pass
        [worker] = named(spans, "fetch_batch")
        assert worker.parent is not None
        assert worker.parent.span_id == webhook.context.span_id
        assert worker.context.trace_id == webhook.context.trace_id
    assert not tracing.enabled()


def test_configure_stays_off_without_the_block_or_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.configure(enabled=False, service_name="nopoll") is False
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.configure(enabled=False, service_name="nopoll") is False
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configure(enabled=False, service_name="nopoll") is False
    assert not tracing.enabled()


def test_configure_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    try:
        assert tracing.configure(enabled=False, service_name="nopoll", role="worker")
        assert tracing.enabled()
        assert tracing.traceparent() is None  # on, but no span is current
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_off_nothing_of_opentelemetry_is_imported() -> None:
    code = (
        "import sys, receiver.runtime, receiver.worker.process, sinks.http, sinks.kafka\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
