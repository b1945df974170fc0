"""Checks of the configuration that compare settings with each other (run by
:class:`receiver.config.settings.Settings` once every section is valid on its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from receiver.config.settings import Settings

__all__ = ["check_replay_window", "settle_held_requests", "settle_timeouts"]


def check_replay_window(settings: Settings) -> None:
    """A webhook-id must be remembered for the whole window its callback is accepted in
    (``tolerance_s`` either side of its timestamp), or a copy could be replayed."""
    for name, p in settings.providers.items():
        if settings.dedupe_ttl_s < 2 * p.tolerance_s:
            raise ValueError(
                f"dedupe_ttl_s ({settings.dedupe_ttl_s} s) must be at least twice providers."
                f"{name}.tolerance_s ({p.tolerance_s} s), the window a callback is accepted in"
            )


def settle_timeouts(settings: Settings) -> None:
    """Timeouts that contradict each other would let a job die silently: a write or a
    request that may take as long as the whole job could never be retried. Unset timeouts
    follow a short job timeout down (set on ``settings`` in place), so shortening one is
    enough."""
    job_s = settings.worker.response_job_timeout_s
    derived = {
        name: sink.model_copy(update={"timeout_s": min(sink.timeout_s, job_s / 2)})
        for name, sink in settings.sinks.items()
        if "timeout_s" not in sink.model_fields_set
    }
    if derived:
        object.__setattr__(settings, "sinks", {**settings.sinks, **derived})
    http_update = {
        name: min(getattr(settings.http, name), job_s * share)
        for name, share in (("connect_timeout_s", 0.25), ("read_timeout_s", 0.5))
        if name not in settings.http.model_fields_set
    }
    if http_update:
        object.__setattr__(settings, "http", settings.http.model_copy(update=http_update))
    for name, sink in settings.sinks.items():
        if sink.timeout_s >= job_s:
            raise ValueError(
                f"sinks.{name}.timeout_s ({sink.timeout_s:g} s) must be below "
                f"worker.response_job_timeout_s ({job_s:g} s)"
            )
    request_s = settings.http.connect_timeout_s + settings.http.read_timeout_s
    if request_s >= job_s:
        raise ValueError(
            f"http.connect_timeout_s + http.read_timeout_s ({request_s:g} s) must be below "
            f"worker.response_job_timeout_s ({job_s:g} s)"
        )
    if settings.batch.lease_s >= settings.batch.job_timeout_s:
        raise ValueError(
            f"batch.lease_s ({settings.batch.lease_s:g} s) must be below "
            f"batch.job_timeout_s ({settings.batch.job_timeout_s:g} s)"
        )


def settle_held_requests(settings: Settings) -> None:
    """The results API's held requests (streams, ``?wait``) may never take the connections
    kept for ``/webhooks``. uvicorn answers 503 to the connection that reaches
    ``api.limit_concurrency`` (every open connection counts), so consumers may hold at
    most ``limit_concurrency - 1 - reserved_for_webhooks``. Unset, the reserve is a
    quarter of the limit and ``results.max_held`` all that is left (set on ``settings``
    in place); set, they are checked."""
    api, results = settings.api, settings.results
    limit = api.limit_concurrency
    if "reserved_for_webhooks" not in api.model_fields_set:
        api = api.model_copy(update={"reserved_for_webhooks": max(1, limit // 4)})
        object.__setattr__(settings, "api", api)
    elif api.reserved_for_webhooks >= limit:
        raise ValueError(
            f"api.reserved_for_webhooks ({api.reserved_for_webhooks}) must be below "
            f"api.limit_concurrency ({limit})"
        )
    room = max(0, limit - 1 - api.reserved_for_webhooks)
    if "max_held" not in results.model_fields_set:
        object.__setattr__(settings, "results", results.model_copy(update={"max_held": room}))
    elif results.max_held > room:
        raise ValueError(
            f"results.max_held ({results.max_held}) leaves no room for "
            f"api.reserved_for_webhooks ({api.reserved_for_webhooks}): at most "
            f"api.limit_concurrency - 1 - api.reserved_for_webhooks ({room}) held requests; "
            "beyond api.limit_concurrency even callbacks are answered 503"
        )
