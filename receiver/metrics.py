"""Prometheus metrics, one registry per process (built at start-up, passed down).

Labels never carry secrets or client-chosen strings: an unknown provider is counted as
``provider="unknown"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from nopoll.envelope import Envelope

__all__ = ["CONTENT_TYPE_LATEST", "MAX_MODELS", "Metrics"]

MAX_MODELS = 100
"""Model names one process labels ``nopoll_tokens`` with; later ones count as ``other``."""

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _counter(r: CollectorRegistry, name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, labels, registry=r)


def _histogram(
    r: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...], *labels: str
) -> Histogram:
    return Histogram(name, doc, labels, buckets=buckets, registry=r)


class Metrics:
    """Every metric nopoll exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._per_request: dict[tuple[str, int | None], tuple[Any, Any]] = {}
        self._per_model: dict[tuple[str, ...], tuple[Any, Any]] = {}
        self._models: set[str] = set()
        self._per_job: dict[tuple[str, str], Any] = {}
        self.callbacks = _counter(
            r, "nopoll_callbacks", "Callbacks by provider and outcome", "provider", "outcome"
        )
        self.verify_seconds = _histogram(
            r, "nopoll_verify_seconds", "Signature verification time", _FAST
        )
        self.dead_letters_dropped = _counter(
            r,
            "nopoll_dead_letters_dropped",
            "Dead letters dropped: beyond a tenant's dead_letters.max_per_tenant, or past ttl_s",
            "tenant",
            "reason",
        )
        self.connection_refusals = _counter(
            r,
            "nopoll_connection_refusals",
            "Requests and connections the API refused to keep connections for callbacks",
            "reason",
        )
        self.enqueue_seconds = _histogram(
            r, "nopoll_enqueue_seconds", "Time to enqueue a callback durably", _FAST
        )
        self.jobs = _counter(
            r, "nopoll_jobs", "Jobs by function and outcome", "function", "outcome"
        )
        self.provider_requests = _counter(
            r, "nopoll_provider_requests", "Provider requests by status", "provider", "status"
        )
        self.provider_seconds = _histogram(
            r, "nopoll_provider_request_seconds", "Provider request latency", _SLOW, "provider"
        )
        self.sink_writes = _counter(
            r, "nopoll_sink_writes", "Sink writes by outcome", "sink", "outcome"
        )
        self.sink_rows = _counter(r, "nopoll_sink_rows", "Rows written by sink", "sink")
        self.sink_seconds = _histogram(
            r, "nopoll_sink_write_seconds", "Sink write latency", _SLOW, "sink"
        )
        self.callback_to_row_seconds = _histogram(
            r,
            "nopoll_callback_to_row_seconds",
            "From a response's callback (received_at) to its row written, by sink",
            (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
            "sink",
        )
        self.dead_letters = _counter(
            r,
            "nopoll_dead_letters",
            "Work that became a dead letter, by sink (or 'fetch', 'watch'); a replayed "
            "letter failing again is not counted again",
            "sink",
        )
        self.batch_rows = _counter(
            r, "nopoll_batch_rows", "Batch rows fetched and handed to the sinks", "provider"
        )
        self.batches = _counter(r, "nopoll_batches", "Batch jobs by outcome", "provider", "outcome")
        self.watch_polls = _counter(
            r, "nopoll_watch_polls", "Polls of watched ids by outcome", "provider", "outcome"
        )
        self.watch_landing_seconds = _histogram(
            r,
            "nopoll_watch_landing_seconds",
            "From the poll that found a watched id terminal to its landing",
            (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
            "provider",
        )
        self.rate_limit_wait_seconds = _counter(
            r,
            "nopoll_rate_limit_wait_seconds",
            "Seconds provider requests waited for a slot (watch.rate_limit_rps, the account's "
            "rate_limit_rps) or out a pause",
            "provider",
        )
        self.rate_limit_pauses = _counter(
            r,
            "nopoll_rate_limit_pauses",
            "Pauses of a provider account: a 429's Retry-After, or X-RateLimit-Remaining 0",
            "provider",
        )
        self._queues = _QueueCollector()
        r.register(self._queues)
        self._watches = _WatchCollector()
        r.register(self._watches)
        self._kept = _KeptCollector()
        r.register(self._kept)
        self.results = _counter(
            r, "nopoll_results", "Results (envelopes) fetched and routed", "provider", "kind"
        )
        self.unrouted = _counter(
            r, "nopoll_unrouted_results", "Results no route sent anywhere", "provider"
        )
        self.tokens = _counter(
            r,
            "nopoll_tokens",
            "Tokens of the results landed (their usage), by direction: input or output",
            "provider",
            "model",
            "tenant",
            "kind",
            "direction",
        )

    def count_job(self, function: str, outcome: str) -> None:
        """One job of ``function`` ended with ``outcome`` (``nopoll_jobs``; the child is
        looked up once per pair, not through ``labels()`` per job)."""
        child = self._per_job.get((function, outcome))
        if child is None:
            child = self._per_job[(function, outcome)] = self.jobs.labels(function, outcome)
        child.inc()

    def _model(self, model: str | None) -> str:
        """The ``model`` label of a model name: the provider's words, so the first
        :data:`MAX_MODELS` names this process meets keep their own series (and Redis
        activity field) and every later one is counted as ``other``."""
        name = (model or "unknown")[:100]
        if name in self._models:
            return name
        if len(self._models) >= MAX_MODELS:
            return "other"
        self._models.add(name)
        return name

    def letters_dropped(self, tenant: str, reason: str, n: int) -> None:
        """Count ``n`` dead letters of ``tenant`` dropped for ``reason``."""
        self.dead_letters_dropped.labels(tenant, reason).inc(n)

    def count_tokens(self, envelopes: Iterable[Envelope]) -> None:
        """Add the usage of landed results to ``nopoll_tokens``: summed first, so a batch
        chunk costs one increment per model and direction, not one per row."""
        sums: dict[tuple[str, ...], list[int]] = {}
        for env in envelopes:
            if env.input_tokens is None and env.output_tokens is None:
                continue
            key = (env.provider, self._model(env.model), env.tenant, env.kind)
            both = sums.get(key)
            if both is None:
                both = sums[key] = [0, 0]
            both[0] += env.input_tokens or 0
            both[1] += env.output_tokens or 0
        for labels, (inputs, outputs) in sums.items():
            pair = self._per_model.get(labels)
            if pair is None:
                pair = self._per_model[labels] = (
                    self.tokens.labels(*labels, "input"),
                    self.tokens.labels(*labels, "output"),
                )
            if inputs:
                pair[0].inc(inputs)
            if outputs:
                pair[1].inc(outputs)

    def set_queue_depths(self, depths: dict[str, float] | None) -> None:
        """Queue gauges read at scrape time; ``None`` (Redis unreachable) leaves them out."""
        self._queues.depths = depths or {}

    def set_watch_counts(self, counts: dict[str, dict[str, int]] | None) -> None:
        """Watches by provider and state, read by the /metrics handler (None: unknown)."""
        self._watches.counts = counts or {}

    def set_dead_letters_kept(self, counts: dict[str, int] | None) -> None:
        """Dead letters kept now, by sink, read by the /metrics handler (None: unknown)."""
        self._kept.counts = counts

    def observe_provider_request(self, provider: str, status: int | None, seconds: float) -> None:
        """Hook for :class:`~receiver.providers.ProviderClient`."""
        key = (provider, status)
        children = self._per_request.get(key)
        if children is None:  # labels() checks and locks: once per provider and status
            children = self._per_request[key] = (
                self.provider_requests.labels(provider, str(status) if status else "error"),
                self.provider_seconds.labels(provider),
            )
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


_QUEUE_HELP = {
    "nopoll_queue_ready_jobs": "Jobs due now in the short-job queue (scale workers on it)",
    "nopoll_queue_deferred_jobs": "Jobs waiting for a retry time in the short-job queue",
    "nopoll_batch_queue_jobs": "Batch jobs queued or running",
    "nopoll_queue_oldest_ready_age_seconds": "Seconds the oldest job due now has waited",
    "nopoll_worker_heartbeat": "1 while a worker's poll-loop heartbeat is in Redis, else 0",
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


class _WatchCollector(Collector):
    """Exports the watches by state the /metrics handler read just before rendering."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "nopoll_watches", "Watches by provider and state", labels=["provider", "state"]
        )
        for provider, by_state in self.counts.items():
            for state, count in by_state.items():
                family.add_metric([provider, state], count)
        yield family


class _KeptCollector(Collector):
    """Exports the dead letters kept now, by sink, read just before rendering (nothing
    when Redis could not be read: no gauge rather than a wrong zero)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.counts is None:
            return
        family = GaugeMetricFamily(
            "nopoll_dead_letters_kept",
            "Dead letters kept now (listed by nopoll dlq list), by sink",
            labels=["sink"],
        )
        for sink, count in sorted(self.counts.items()):
            family.add_metric([sink], count)
        yield family
