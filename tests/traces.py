"""Tracing into memory: the SDK's InMemorySpanExporter behind nopoll's tracer, for the
tests that check which spans a result makes and how they link."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from receiver import tracing

__all__ = ["in_memory_traces", "named", "traceparent_of"]


@contextlib.contextmanager
def in_memory_traces() -> Iterator[InMemorySpanExporter]:
    """nopoll traces into the exporter it yields (each span as it ends), then stops."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The finished spans called ``name``."""
    return [s for s in exporter.get_finished_spans() if s.name == name]


def traceparent_of(span: ReadableSpan) -> str:
    """The W3C ``traceparent`` a child of ``span`` is sent with."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
