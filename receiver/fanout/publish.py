"""The worker's side of the results API: the built-in ``_results`` sink takes every envelope.

When ``consumer_tokens`` are configured, :func:`add_publication` adds the sink
(:class:`sinks.results.ResultsSink`) to the worker's sinks and wraps the router so that
every envelope also goes to it, whatever the routes say. It is a sink like the others:
opened lazily, written under a timeout, measured, retried on its own and dead-lettered
(``nopoll dlq list --sink _results``).
"""

from __future__ import annotations

from nopoll.envelope import Envelope
from nopoll.exceptions import ConfigError
from receiver.config.settings import Settings
from receiver.fanout.fanout import ManagedSink
from receiver.fanout.routing import Router
from receiver.metrics import Metrics
from receiver.redis.connector import RedisConnector
from sinks.base import SinkConfig
from sinks.results import RESULTS_SINK, ResultsSink, ResultsSinkConfig

__all__ = ["add_publication"]


class _PublishingRouter(Router):
    """The configured routes, plus the ``_results`` sink for every envelope."""

    def __init__(self, routed: Router, metrics: Metrics) -> None:
        self._routed = routed
        self._metrics = metrics
        self._always = (RESULTS_SINK,)

    def sinks_for(self, env: Envelope) -> tuple[str, ...]:
        names = self._routed.sinks_for(env)
        if not names:  # FanOut counts only envelopes that go nowhere; this one goes here
            self._metrics.unrouted.labels(env.provider).inc()
        return names + self._always


def add_publication(
    sinks: dict[str, ManagedSink],
    router: Router,
    settings: Settings,
    redis: RedisConnector,
    metrics: Metrics,
) -> Router:
    """With consumer tokens: put the ``_results`` sink in ``sinks`` and return the router
    that sends it every envelope; without: ``router`` unchanged."""
    if not settings.consumer_tokens:
        return router
    if RESULTS_SINK in sinks:
        raise ConfigError(
            f"sinks.{RESULTS_SINK}: the name is reserved for the results API's own sink"
        )
    job_s = settings.worker.response_job_timeout_s
    config = ResultsSinkConfig(
        stream_max_entries=settings.results.stream_max_entries,
        stream_retention_s=settings.results.stream_retention_s,
        latest_ttl_s=settings.results.latest_ttl_s,
        stream_inline_bytes=settings.results.stream_inline_bytes,
        timeout_s=min(30.0, job_s / 2),
    )

    # its class is not in the sink registry, so that ``sinks:`` cannot name it
    def results_sink(name: str, config: SinkConfig) -> ResultsSink:
        return ResultsSink(name, config, connect=lambda s: redis.client("results", at_most_s=s))

    sinks[RESULTS_SINK] = ManagedSink(RESULTS_SINK, config, metrics, factory=results_sink)
    return _PublishingRouter(router, metrics)
