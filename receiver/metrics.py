"""Prometheus metrics, one registry per process (built at start-up, passed down).

Labels never carry secrets or client-chosen strings: an unknown provider is counted as
``provider="unknown"``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Every metric nopoll exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.callbacks = Counter(
            "nopoll_callbacks",
            "Callbacks by provider and outcome",
            ["provider", "outcome"],
            registry=r,
        )
        self.verify_seconds = Histogram(
            "nopoll_verify_seconds", "Signature verification time", buckets=_FAST, registry=r
        )
        self.enqueue_seconds = Histogram(
            "nopoll_enqueue_seconds",
            "Time to enqueue a callback durably",
            buckets=_FAST,
            registry=r,
        )
        self.jobs = Counter(
            "nopoll_jobs", "Jobs by function and outcome", ["function", "outcome"], registry=r
        )
        self.provider_requests = Counter(
            "nopoll_provider_requests",
            "Provider requests by status",
            ["provider", "status"],
            registry=r,
        )
        self.provider_seconds = Histogram(
            "nopoll_provider_request_seconds",
            "Provider request latency",
            ["provider"],
            buckets=_SLOW,
            registry=r,
        )
        self.sink_writes = Counter(
            "nopoll_sink_writes", "Sink writes by outcome", ["sink", "outcome"], registry=r
        )
        self.sink_rows = Counter("nopoll_sink_rows", "Rows written by sink", ["sink"], registry=r)
        self.sink_seconds = Histogram(
            "nopoll_sink_write_seconds", "Sink write latency", ["sink"], buckets=_SLOW, registry=r
        )
        self.dead_letters = Counter(
            "nopoll_dead_letters", "Dead letters by sink (or 'fetch')", ["sink"], registry=r
        )
        self.batch_rows = Counter(
            "nopoll_batch_rows",
            "Batch rows fetched and handed to the sinks",
            ["provider"],
            registry=r,
        )
        self.batches = Counter(
            "nopoll_batches", "Batch jobs by outcome", ["provider", "outcome"], registry=r
        )
        self._queues = _QueueCollector()
        r.register(self._queues)
        self.unrouted = Counter(
            "nopoll_unrouted_results", "Results no route sent anywhere", ["provider"], registry=r
        )

    def set_queue_depths(self, depths: dict[str, float] | None) -> None:
        """Queue gauges read at scrape time; ``None`` (Redis unreachable) leaves them out."""
        self._queues.depths = depths or {}

    def observe_provider_request(self, provider: str, status: int | None, seconds: float) -> None:
        """Hook for :class:`~receiver.providers.ProviderClient`."""
        self.provider_requests.labels(provider, str(status) if status else "error").inc()
        self.provider_seconds.labels(provider).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


_QUEUE_HELP = {
    "nopoll_queue_ready_jobs": "Jobs due now in the short-job queue (scale workers on it)",
    "nopoll_queue_deferred_jobs": "Jobs waiting for a retry time in the short-job queue",
    "nopoll_batch_queue_jobs": "Batch jobs queued or running",
}


class _QueueCollector(Collector):
    """Exports the queue depths the /metrics handler read just before rendering."""

    def __init__(self) -> None:
        self.depths: dict[str, float] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in self.depths.items():
            family = GaugeMetricFamily(name, _QUEUE_HELP.get(name, name))
            family.add_metric([], value)
            yield family
