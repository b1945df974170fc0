"""The current trace context as headers for a sink's subscribers (W3C ``traceparent``).

Sinks never import the receiver: they take the context from OpenTelemetry's API directly,
as any instrumented library does. A process that never imported OpenTelemetry has no span
to pass on, so nothing is imported or added then.
"""

from __future__ import annotations

import sys

__all__ = ["trace_headers"]


def trace_headers() -> dict[str, str]:
    """``traceparent`` (and whatever else the configured propagators carry) of the current
    span; empty when nothing traces in this process."""
    if "opentelemetry.trace" not in sys.modules:
        return {}
    try:
        from opentelemetry import propagate
    except ImportError:  # pragma: no cover - imported above by whoever traces
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
