"""Fan-out: write envelopes to their routed sinks side by side, each on its own.

Each sink is opened lazily (a database that is down at start-up is just a failing
sink) and every write runs under the sink's timeout. A sink that fails does not block
the others: the caller gets the failures back and queues a retry for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError, SinkRejected
from nopoll.kinds import SINGLE_KINDS
from receiver.fanout.routing import Router
from receiver.metrics import Metrics
from receiver.tracing import enabled as tracing_enabled
from receiver.tracing import span
from sinks.base import (
    ClaimCheck,
    ClaimCheckConfig,
    HoldsClaims,
    Sink,
    SinkConfig,
    UsesClaimCheck,
    WritesBatchParts,
)
from sinks.registry import create_sink

__all__ = ["FanOut", "ManagedSink"]


class ManagedSink:
    """One configured sink: opened on first use, written under a timeout, measured.

    ``factory`` makes the sink: by default the registry's class for the config's
    ``type:``; the built-in ``_results`` sink, which ``sinks:`` cannot name, passes its own."""

    def __init__(
        self,
        name: str,
        config: SinkConfig,
        metrics: Metrics,
        *,
        factory: Callable[[str, SinkConfig], Sink] = create_sink,
    ) -> None:
        self.name = name
        self.config = config
        self._factory = factory
        self._ok = metrics.sink_writes.labels(name, "ok")
        self._errors = metrics.sink_writes.labels(name, "error")
        self._rows = metrics.sink_rows.labels(name)
        self._seconds = metrics.sink_seconds.labels(name)
        self._landed = metrics.callback_to_row_seconds.labels(name)
        self._sink: Sink | None = None
        self._lock = asyncio.Lock()
        self.claim_check: ClaimCheck | None = None
        """Where a sink with a size limit (Kafka) puts bodies too large to carry."""
        self.state = "not opened"
        """``ok`` after a write went through, ``failing`` after one failed, ``not opened``."""
        self.error: str | None = None
        """The last write's error while failing (never a secret: sink errors carry none)."""
        self.since = time.time()
        """When ``state`` last changed (Unix seconds)."""

    def _record(self, error: BaseException | None) -> None:
        state = "ok" if error is None else "failing"
        if state != self.state:
            self.state, self.since = state, time.time()
        self.error = None if error is None else str(error)[:300]

    async def _opened(self) -> Sink:
        if self._sink is not None:
            return self._sink
        async with self._lock:
            if self._sink is None:
                sink = self._factory(self.name, self.config)
                if self.claim_check is not None and isinstance(sink, UsesClaimCheck):
                    sink.claim_check = self.claim_check
                try:
                    await sink.open()
                except BaseException:
                    # failed or cancelled (a worker stopped during start-up): what the
                    # open had made is closed now, not left for the garbage collector
                    with contextlib.suppress(Exception):
                        await asyncio.shield(sink.aclose())
                    raise
                self._sink = sink
        return self._sink

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        """Open if needed and write; raises SinkError on any failure or timeout."""
        await self._timed(None, envelopes)

    async def write_part(self, part: int, envelopes: Sequence[Envelope]) -> None:
        """Write one numbered chunk of a batch's rows: through the sink's
        ``write_batch_part(part, envelopes)`` when it :class:`WritesBatchParts` (S3 part
        files), else ``write``."""
        await self._timed(part, envelopes)

    async def _timed(self, part: int | None, envelopes: Sequence[Envelope]) -> None:
        if not tracing_enabled() or not envelopes:  # an empty write only opens the sink
            await self._write(part, envelopes)
            return
        attributes = {"nopoll.sink": self.name, "nopoll.rows": len(envelopes)}
        with span(f"write {self.name}", attributes, kind="client"):
            await self._write(part, envelopes)

    async def _write(self, part: int | None, envelopes: Sequence[Envelope]) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                sink = await self._opened()
                if part is not None and isinstance(sink, WritesBatchParts):
                    await sink.write_batch_part(part, envelopes)
                else:
                    await sink.write(envelopes)
        except TimeoutError:
            self._errors.inc()
            error = SinkError(f"write timed out after {self.config.timeout_s:g}s", sink=self.name)
            self._record(error)
            raise error from None
        except SinkRejected:  # the data's fault, not the sink's: it still works
            self._errors.inc()
            self._record(None)
            raise
        except SinkError as exc:
            self._errors.inc()
            self._record(exc)
            raise
        except Exception as exc:
            self._errors.inc()
            error = SinkError(f"{type(exc).__name__}: {exc}"[:500], sink=self.name)
            self._record(error)
            raise error from exc
        self._record(None)
        self._ok.inc()
        self._rows.inc(len(envelopes))
        self._seconds.observe(time.perf_counter() - started)
        if part is None:
            now = time.time()
            for env in envelopes:
                if env.kind in SINGLE_KINDS:
                    received = datetime.fromisoformat(env.received_at).timestamp()
                    self._landed.observe(max(0.0, now - received))

    async def put_claim(self, env: Envelope) -> str:
        """Store ``env``'s body with this (S3) sink; returns the reference to carry instead."""
        sink = await self._opened()
        if not isinstance(sink, HoldsClaims):
            raise SinkError("this sink cannot hold claim-checked bodies", sink=self.name)
        return str(await sink.put_claim(env))

    async def aclose(self) -> None:
        if self._sink is not None:
            sink, self._sink = self._sink, None
            await sink.aclose()


class FanOut:
    """Routes envelopes and writes each sink's share concurrently."""

    def __init__(self, sinks: Mapping[str, ManagedSink], router: Router, metrics: Metrics) -> None:
        self.sinks = dict(sinks)
        # Claim-check: a sink whose config names another (``claim_check: lake``) puts the
        # bodies too large for it there (validated at start-up).
        for sink in self.sinks.values():
            if not isinstance(sink.config, ClaimCheckConfig):
                continue
            target = sink.config.claim_check
            if target is not None and target in self.sinks:
                sink.claim_check = self.sinks[target].put_claim
        self._router = router
        self._metrics = metrics
        self.fingerprints = {name: sink.config.fingerprint() for name, sink in self.sinks.items()}
        """Each sink's config fingerprint, which the deliveries queued for it carry."""

    def route(self, envelopes: Sequence[Envelope]) -> dict[str, list[Envelope]]:
        """Each sink's share of ``envelopes`` (sinks with no share are left out). Called
        once per landed result (per chunk of a batch), it counts them and their tokens."""
        shares: dict[str, list[Envelope]] = defaultdict(list)
        for (provider, kind), n in Counter((e.provider, e.kind) for e in envelopes).items():
            self._metrics.results.labels(provider, kind).inc(n)
        self._metrics.count_tokens(envelopes)  # once per result, as nopoll_results
        for env in envelopes:
            names = self._router.sinks_for(env)
            if not names:
                self._metrics.unrouted.labels(env.provider).inc()
            for name in names:
                shares[name].append(env)
        return shares

    async def write(self, shares: Mapping[str, Sequence[Envelope]]) -> dict[str, SinkError]:
        """Write every share side by side; returns the failures by sink name."""
        names = list(shares)
        results: list[BaseException | None]
        if len(names) == 1:  # one sink (the usual case): no task to run it in
            results = [None]
            try:
                await self.sinks[names[0]].write(shares[names[0]])
            except Exception as exc:
                results = [exc]
        else:
            results = await asyncio.gather(
                *(self.sinks[n].write(shares[n]) for n in names), return_exceptions=True
            )
        failures: dict[str, SinkError] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, SinkError):
                failures[name] = result
            elif isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation: let the job be re-run
                failures[name] = SinkError(f"{type(result).__name__}: {result}", sink=name)
        return failures

    async def aclose(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self.sinks.values()), return_exceptions=True)
