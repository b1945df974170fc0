"""OpenTelemetry traces, opt-in: one trace per result, from its callback to its rows.

Off by default, and then nothing of OpenTelemetry is imported: :func:`span` hands back
one shared no-op context and :func:`traceparent` None. :func:`configure` turns tracing on
for the process (an ``otel:`` block or the ``OTEL_*`` variables); a test passes its own
tracer provider to :func:`use`. The W3C ``traceparent`` travels in the job's kwargs
(:mod:`receiver.queue.jobs`), so the worker's spans continue the callback's trace. The
tracer is the process's: one module slot, set once at start-up.

See docs/configuration.md (traces) for the spans.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from nopoll.exceptions import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["configure", "enabled", "env_asks", "shutdown", "span", "traceparent", "use"]

log = logging.getLogger("nopoll.tracing")

_INSTALL = "pip install 'nopoll[otel]' (OTLP over HTTP, and console)"

SpanKind = Literal["internal", "server", "client", "producer", "consumer"]

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def enabled() -> bool:
    """Whether this process traces."""
    return _tracer is not None


def env_asks() -> bool:
    """Whether the environment turns tracing on: ``OTEL_TRACES_EXPORTER`` set to an
    exporter (not ``none``), and ``OTEL_SDK_DISABLED`` not ``true``."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    return exporter not in ("", "none")


def use(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` from now on (None: stop tracing)."""
    global _tracer, _provider
    _tracer = None if provider is None else provider.get_tracer("nopoll")
    _provider = provider


def shutdown() -> None:
    """Export the spans still buffered and stop tracing (a process's last step)."""
    provider = _provider
    use(None)
    if provider is not None:
        provider.shutdown()


def configure(
    *,
    enabled: bool,
    service_name: str,
    exporter: str | None = None,
    endpoint: str | None = None,
    role: str = "",
) -> bool:
    """Turn tracing on for this process when ``enabled`` (the ``otel:`` block) or the
    environment (:func:`env_asks`) asks for it; True when it is on. The exporter is
    ``exporter`` or ``OTEL_TRACES_EXPORTER`` (``otlp``, the default: OTLP over HTTP;
    ``console``; or any installed exporter's entry-point name), its address ``endpoint`` or
    the ``OTEL_EXPORTER_OTLP_*`` variables; the sampler and resource follow
    ``OTEL_TRACES_SAMPLER`` and ``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads them."""
    if not (enabled or env_asks()):
        return False
    from importlib.metadata import entry_points

    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(f"traces need OpenTelemetry's SDK ({exc}): {_INSTALL}") from None

    name = (exporter or os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    name = name.split(",")[0].strip()
    if name == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", ""
        )
        name = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ConfigError(f"no OpenTelemetry trace exporter {name!r} is installed: {_INSTALL}")
    exporter_class = next(iter(found)).load()
    kwargs: dict[str, Any] = {}
    if endpoint is not None and name == "otlp_proto_http":
        kwargs["endpoint"] = endpoint.rstrip("/") + "/v1/traces"
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name}
    if role:
        attributes["nopoll.role"] = role
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter_class(**kwargs)))
    trace.set_tracer_provider(provider)  # for libraries that trace through the global API
    use(provider)
    log.info("tracing on: exporter %s, service %s", name, attributes["service.name"])
    return True


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: str | None = None,
    kind: SpanKind = "internal",
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around the block (yields it; None while tracing is off), a child of the
    current one, or of ``parent`` (a W3C ``traceparent``: a job continuing its callback's
    trace). An exception leaving the block is recorded on it."""
    if _tracer is None:
        return _OFF
    return _span(_tracer, name, attributes, parent, kind)


@contextlib.contextmanager
def _span(
    tracer: Tracer,
    name: str,
    attributes: Mapping[str, Any] | None,
    parent: str | None,
    kind: SpanKind,
) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind as Kind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = None
    if parent is not None:
        context = TraceContextTextMapPropagator().extract({"traceparent": parent})
    with tracer.start_as_current_span(
        name, context=context, kind=Kind[kind.upper()], attributes=attributes
    ) as current:
        yield current


def traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (to carry in a job), or None: tracing is off
    or no span is current."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")
