"""A provider simulator: a real HTTP server on 127.0.0.1 that speaks the provider API.

Used by ``nopoll demo``, the tests and the benchmarks. :class:`ProviderSimulator` serves
the responses it was told about, with injected faults (429, 500, slow, unfinished,
oversize: :class:`~receiver.demo.answers.Oversize`), counts every request, and sends
callbacks signed by the ``standardwebhooks`` package. Creates are
:mod:`receiver.demo.creates`, Anthropic's Message Batches :mod:`receiver.demo.anthropic`
(at :attr:`ProviderSimulator.host_url`), Valar's rate limits :mod:`receiver.demo.limits`.
Its objects, errors, lists and ids follow one dialect's published contract
(:mod:`receiver.demo.profiles`).

See docs/providers.md.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from receiver.demo.answers import Oversize, answer, json_answer
from receiver.demo.anthropic import AnthropicBatches
from receiver.demo.batches import SimBatch
from receiver.demo.creates import CreateSettings, Creations, created_output_text
from receiver.demo.ids import prefixed_id, uuid7
from receiver.demo.limits import RateLimits
from receiver.demo.profiles import PROFILES, SimProfile
from receiver.demo.responses import (
    generated_response,
    make_response,
    pending_phase,
    send_callback,
    sign_callback,
)

__all__ = [
    "ProviderSimulator",
    "SimResponse",
    "generated_response",
    "make_response",
    "send_callback",
    "sign_callback",
]


@dataclass
class SimResponse:
    """A response the simulator serves, with how it misbehaves first."""

    body: dict[str, Any]
    """The finished object, OpenAI's shape (served in ``profile``'s)."""
    profile: SimProfile = PROFILES["openai"]
    fail_times: int = 0
    fail_status: int = 500
    retry_after: float | None = None
    delay_s: float = 0.0
    delay_times: int | None = None
    """Delay only the first N answers by ``delay_s`` (None: every answer)."""
    pending_times: int = 0
    """Answer the first N successful GETs with the object not finished yet."""
    pending_status: str | None = None
    """Its status while not finished (None: the dialect's, in the first then the second half
    of the wait, see :attr:`SimProfile.response_statuses`)."""
    pending_until: float | None = None
    """Unix time before which every GET finds the object not finished."""
    started_at: float = field(default_factory=time.time)
    gzip: bool = False
    """Answer with ``Content-Encoding: gzip``."""
    oversize: Oversize | None = None
    """Answer too large for nopoll's caps (padded, endless or a gzip bomb)."""
    served: int = 0

    def pending(self, successes: int, now: float) -> str | None:
        """The status of its ``successes``-th successful answer while not finished, None
        once finished."""
        statuses = self.profile.response_statuses
        if successes <= self.pending_times:
            status = statuses[1] if successes <= (self.pending_times + 1) // 2 else statuses[2]
        elif self.pending_until is not None and now < self.pending_until:
            status = pending_phase(statuses, self.started_at, self.pending_until, now)
        else:
            return None
        return self.pending_status or status


_BEHAVIOUR = {f.name for f in fields(SimResponse)} - {"body", "served", "profile", "started_at"}
_GENERATED_ID = re.compile(
    r"resp_[A-Za-z0-9_.:-]{1,251}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
)
"""Ids an auto-responding simulator answers: ``resp_…`` (and UUIDs, sference's)."""


@dataclass
class _State:
    responses: dict[str, SimResponse] = field(default_factory=dict)
    batches: dict[str, Any] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    by_key: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    times: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=200_000))
    """(arrival time, path) of the latest requests, for rate checks."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    default_delay_s: float = 0.0
    auto_respond: bool = False


_Endpoint = Callable[[Request], Awaitable[Response]]


def _error(
    profile: SimProfile, status: int, message: str, headers: dict[str, str] | None = None
) -> Response:
    body = profile.error_body(status, message)
    return Response(body, status, headers=headers, media_type="application/json")


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int | None:
    """Query parameter ``name`` as an integer in ``low..high`` (``default`` when absent);
    None when it is not one."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = int(raw) if raw.strip().lstrip("-").isdigit() else None
    return value if value is not None and low <= value <= high else None


class _Routes:
    """The simulator's endpoints over its shared :class:`_State` (every request counted)."""

    def __init__(self, state: _State, api_keys: frozenset[str] | None, creates: Creations) -> None:
        self.state = state
        self.api_keys = api_keys
        self.creates = creates

    @property
    def profile(self) -> SimProfile:
        """The profile of the dialect the simulator speaks."""
        return self.creates.settings.profile

    def _count(self, request: Request) -> None:
        with self.state.lock:
            self.state.requests[request.url.path] += 1
            self.state.times.append((time.time(), request.url.path))

    def _authorized(self, request: Request) -> bool:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if self.api_keys is not None and (scheme != "Bearer" or key not in self.api_keys):
            return False
        with self.state.lock:  # the paths each key was let in to
            self.state.by_key[key][request.url.path] += 1
        return True

    def guarded(self, endpoint: _Endpoint) -> _Endpoint:
        """``endpoint`` counted and behind the same Bearer check as the GET routes."""

        async def guarded(request: Request) -> Response:
            self._count(request)
            if not self._authorized(request):
                return _error(self.profile, 401, "bad api key")
            return await endpoint(request)

        return guarded

    async def get_response(self, request: Request) -> Response:
        state = self.state
        rid = request.path_params["rid"]
        with state.lock:
            state.requests[request.url.path] += 1
            state.times.append((time.time(), request.url.path))
            sim = state.responses.get(rid)
            if sim is None and (created := self.creates.response(rid)) is not None:
                body, made = created
                sim = SimResponse(
                    body=body,
                    profile=self.profile,
                    pending_until=made.completes_at,
                    started_at=made.created_at,
                )
            if sim is not None:
                sim.served += 1
                failing = sim.served <= sim.fail_times
                pending = sim.pending(sim.served - sim.fail_times, time.time())
                slow = sim.delay_times is None or sim.served <= sim.delay_times
        if not self._authorized(request):
            return _error(self.profile, 401, "bad api key")
        if sim is None and state.auto_respond and _GENERATED_ID.fullmatch(rid):
            return json_answer(self.profile.shape_response(generated_response(rid), None))
        if sim is None:
            return _error(self.profile, 404, "no such response")
        delay = (sim.delay_s if slow else 0.0) or state.default_delay_s
        if delay:
            await asyncio.sleep(delay)
        if failing:
            retry_after = sim.retry_after
            headers = {"retry-after": f"{retry_after:g}"} if retry_after is not None else {}
            return _error(sim.profile, sim.fail_status, "try again", headers)
        body = sim.profile.shape_response(sim.body, pending)
        return json_answer(body, oversize=sim.oversize, gzip=sim.gzip)

    def _streams_refused(self, request: Request) -> Response | None:
        """The answer to a streams route the key or the dialect does not allow, or None."""
        if not self._authorized(request):
            return _error(self.profile, 401, "bad api key")
        if not self.profile.streams:
            return _error(self.profile, 404, "Not Found")
        return None

    async def list_responses(self, request: Request) -> Response:
        """``GET /v1/responses?stream_id=&limit=``: sference's ``ResponseList``, newest first."""
        self._count(request)
        profile = self.profile
        if (refused := self._streams_refused(request)) is not None:
            return refused
        limit = _int_param(request, "limit", 100, 1, 10_000)
        if limit is None:
            return _error(profile, 400, "limit: must be a positive integer")
        stream_id = request.query_params.get("stream_id") or None
        made = self.creates.responses(stream_id)
        data, now, statuses = [], time.time(), profile.response_statuses
        for rid, m in made[:limit]:
            pending = None
            if now < m.completes_at:
                pending = pending_phase(statuses, m.created_at, m.completes_at, now)
            created = self.creates.response(rid)
            assert created is not None
            item = profile.shape_response(created[0], pending)
            data.append({k: item[k] for k in ("id", "object", "created_at", "model", "status")})
        body = {"object": "list", "data": data, "has_more": len(made) > limit}
        return json_answer(body)

    async def list_events(self, request: Request) -> Response:
        """``GET /v1/responses/events``: sference's completion feed (``StreamEventListResponse``,
        :mod:`receiver.demo.feed`)."""
        self._count(request)
        profile = self.profile
        if (refused := self._streams_refused(request)) is not None:
            return refused
        limit = _int_param(request, "limit", 20, 1, 10_000)
        wait_ms = _int_param(request, "wait_ms", 0, 0, 10**9)
        if limit is None or wait_ms is None:
            return _error(profile, 400, "limit and wait_ms: must be integers, limit at least 1")
        query = request.query_params
        data, more = await self.creates.feed.wait_page(
            query.get("stream_id") or None,
            limit=min(limit, 1000),
            starting_after=query.get("starting_after") or None,
            ending_before=query.get("ending_before") or None,
            wait_ms=wait_ms,
        )
        return json_answer({"object": "list", "data": data, "has_more": more})

    def _batch(self, request: Request) -> SimBatch | Response:
        """The batch of the path, or the answer that refuses the request."""
        self._count(request)
        if not self._authorized(request):
            return _error(self.profile, 401, "bad api key")
        batch: SimBatch | None = self.state.batches.get(request.path_params["bid"])
        return _error(self.profile, 404, "no such batch") if batch is None else batch

    async def get_batch(self, request: Request) -> Response:
        batch = self._batch(request)
        if isinstance(batch, Response):
            return batch
        with self.state.lock:
            progress = batch.poll()
        if batch.guide and progress >= 1:  # inline results, streamed as they are written
            document = batch.guide_document(progress)
            return answer(document, media_type="application/json", gzip=batch.gzipped_results)
        if batch.guide:
            parts = list(batch.guide_document(progress))
            return answer(parts, media_type="application/json", gzip=batch.gzip)
        return json_answer(batch.batch_object(progress), gzip=batch.gzip)

    async def cancel_batch(self, request: Request) -> Response:
        """``POST /v1/batches/{id}/cancel`` (sference): the batch, cancelled unless ended."""
        batch = self._batch(request)
        if isinstance(batch, Response):
            return batch
        if not batch.profile.cancel:
            return _error(batch.profile, 404, "no such route")
        with self.state.lock:
            batch.cancel()
            obj = batch.batch_object()
        return json_answer(obj, gzip=batch.gzip)

    async def list_batches(self, request: Request) -> Response:
        """``GET /v1/batches`` in the simulator's dialect: sference's ``{items}``, or Sail's
        and Valar's bare array paged by ``after_id``/``before_id``/``limit``."""
        self._count(request)
        profile = self.profile
        if not self._authorized(request):
            return _error(profile, 401, "bad api key")
        if profile.batch_list is None:
            return _error(profile, 404, "no such route")
        with self.state.lock:
            batches = [b for b in self.state.batches.values() if b.profile is profile]
        batches.reverse()  # newest first (registered in creation order)
        batches.sort(key=lambda b: -b.created_at)
        if profile.batch_list == "items":
            with self.state.lock:
                items = [b.batch_object() for b in batches]
            return json_answer({"items": items})
        limit = _int_param(request, "limit", 25, 1, 200)
        if limit is None:
            return _error(profile, 400, "limit: an integer from 1 to 200")
        ids = [b.batch_id for b in batches]
        after, before = request.query_params.get("after_id"), request.query_params.get("before_id")
        for name, cursor in (("after_id", after), ("before_id", before)):
            if cursor is not None and cursor not in ids:
                return _error(profile, 400, f"{name}: no batch {cursor}")
        if before is not None:  # created before it: older, after it in this order
            batches = batches[ids.index(before) + 1 :][:limit]
        elif after is not None:  # created after it: newer, the ones just before it
            newer = batches[: ids.index(after)]
            batches = newer[max(0, len(newer) - limit) :]
        else:
            batches = batches[:limit]
        return Response(orjson.dumps([b.summary() for b in batches]), media_type="application/json")

    async def get_batch_part(self, request: Request) -> Response:
        batch = self._batch(request)
        if isinstance(batch, Response):
            return batch
        part = request.path_params["part"]
        if part == batch.profile.results_file:  # the rows ended so far, streamed
            lines = batch.sference_lines()
            return answer(lines, media_type="application/jsonl", gzip=batch.gzipped_results)
        if not batch.profile.request_status:
            return _error(batch.profile, 404, "no such result")
        if batch.row_delay_s or self.state.default_delay_s:
            await asyncio.sleep(batch.row_delay_s or self.state.default_delay_s)
        with self.state.lock:
            status, body = batch.row_object(part)
        if status != 200 or body is None:
            message = "no such request in this batch" if status == 404 else "try again"
            return _error(batch.profile, status, message)
        return json_answer(body, oversize=batch.row_oversize.get(part), gzip=batch.gzip)

    async def get_file(self, request: Request) -> Response:
        self._count(request)
        if not self._authorized(request):
            return _error(self.profile, 401, "bad api key")
        fid = request.path_params["fid"]
        for prefix, errors in (("file-out-", False), ("file-err-", True)):
            if fid.startswith(prefix):
                batch = self.state.batches.get(fid[len(prefix) :])
                if batch is not None and batch.profile.output_files:
                    lines = batch.openai_lines(errors)
                    return answer(lines, media_type="application/jsonl", gzip=batch.gzipped_results)
        return _error(self.profile, 404, "no such file")

    async def get_streams(self, request: Request) -> Response:
        """``GET /v1/streams`` and ``GET /v1/streams/{id}`` (sference)."""
        self._count(request)
        profile = self.profile
        if (refused := self._streams_refused(request)) is not None:
            return refused
        sid = request.path_params.get("sid")
        if sid is None:
            return json_answer({"items": [s.list_item() for s in self.creates.streams()]})
        stream = self.creates.stream(sid)
        if stream is None:
            return _error(profile, 404, "no such stream")
        return json_answer(self.creates.stream_detail(stream))


class ProviderSimulator:
    """Run with ``with ProviderSimulator() as sim:``; ``sim.base_url`` ends in ``/v1``.

    With ``auto_respond=True``, ``GET /v1/responses/resp_...`` (or a UUID) for an id it was
    never told about answers :func:`generated_response` instead of 404 (``nopoll simulate``
    uses it, so any id a user sends a test callback for can be fetched). With
    ``rate_limit_per_min``, every API key is limited as Valar limits it (see
    :mod:`receiver.demo.limits`; ``sim.limits.quota_exceeded`` turns the spend cap on). Other
    keywords are :class:`~receiver.demo.creates.CreateSettings` (``sim.creates.settings``
    later), ``dialect`` among them: the API it speaks.
    """

    def __init__(
        self,
        *,
        api_key: str | Sequence[str] | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        auto_respond: bool = False,
        rate_limit_per_min: int | None = None,
        **create: Any,
    ) -> None:
        self.state = _State(auto_respond=auto_respond)
        self.limits = RateLimits(rate_limit_per_min)
        """The request limits (Valar's): the buckets and the spend-cap switch."""
        self.creates = Creations(CreateSettings(**create), self.add_batch)
        """The create side: its settings, what it created and received."""
        keys = [api_key] if isinstance(api_key, str) else api_key  # several: several accounts
        self._api_keys = None if keys is None else frozenset(keys)
        self.anthropic = AnthropicBatches(
            self._count,
            self._api_keys,
            complete_after_s=lambda: self.creates.settings.complete_after_s,
            created_text=created_output_text,
        )
        """Anthropic's Message Batches (the ``anthropic`` dialect's routes)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit this: without it, keep-alive answers wait ~40 ms for
        # the client's delayed ACK (Nagle), and a 1 ms endpoint looks like a 40 ms one.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        # A wildcard address is reachable here as the loopback address.
        shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self.host_url = f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}"
        """The server's root: the ``anthropic`` dialect's ``base_url``."""
        self.base_url = f"{self.host_url}/v1"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # --- what tests and the demo call -------------------------------------------------
    @property
    def dialect(self) -> str:
        """The API the simulator speaks."""
        return self.creates.settings.dialect

    def add_response(self, response_id: str | None = None, **kwargs: Any) -> SimResponse:
        """Register a finished response, served in the simulator's dialect;
        ``fail_times``/``fail_status``/``retry_after``/``delay_s``/``delay_times``/
        ``pending_times`` make it misbehave first, ``gzip``/``oversize`` change how it is sent
        (see :class:`SimResponse`); other kwargs go to :func:`make_response`. Without an id,
        one of the dialect's own (``resp_…`` or a UUID)."""
        profile = self.creates.settings.profile
        rid = response_id or (uuid7() if profile.ids == "uuid" else prefixed_id("resp"))
        behaviour = {k: kwargs.pop(k) for k in _BEHAVIOUR if k in kwargs}
        sim = SimResponse(body=make_response(rid, **kwargs), profile=profile, **behaviour)
        with self.state.lock:
            self.state.responses[rid] = sim
        return sim

    def add_batch(self, dialect: str, batch_id: str, n_rows: int, **kwargs: Any) -> Any:
        """Register a finished batch in ``dialect``'s shape (see :class:`SimBatch`; for
        ``anthropic``, :class:`~receiver.demo.anthropic.AnthropicBatch`)."""
        if PROFILES[dialect].message_batches:
            return self.anthropic.add(batch_id, n_rows, **kwargs)

        batch = SimBatch(dialect=dialect, batch_id=batch_id, n_rows=n_rows, **kwargs)
        with self.state.lock:
            self.state.batches[batch_id] = batch
        return batch

    def _count(self, request: Request) -> None:
        with self.state.lock:
            self.state.requests[request.url.path] += 1
            self.state.times.append((time.time(), request.url.path))

    def request_times(self, path_prefix: str = "") -> list[float]:
        """Arrival times of the latest requests whose path starts with ``path_prefix``."""
        with self.state.lock:
            return [t for t, p in self.state.times if p.startswith(path_prefix)]

    def request_count(self, path_prefix: str = "", api_key: str | None = None) -> int:
        """How many requests arrived whose path starts with ``path_prefix`` (``api_key``:
        how many of them were let in with that key)."""
        with self.state.lock:
            counts = self.state.requests if api_key is None else self.state.by_key[api_key]
            return sum(n for p, n in counts.items() if p.startswith(path_prefix))

    def creations(self, kind: str) -> int:
        """How many ``responses``, ``files`` or ``batches`` the create routes really created."""
        return self.creates.creations(kind)

    def set_delay(self, seconds: float) -> None:
        """Delay every answer by ``seconds`` (a slow provider)."""
        self.state.default_delay_s = seconds

    # --- the server ---------------------------------------------------------------------
    def _app(self) -> Any:
        routes, creates = _Routes(self.state, self._api_keys, self.creates), self.creates
        app = Starlette(
            routes=[
                *(
                    Route(f"/v1/{kind}", routes.guarded(creates.endpoint(kind)), methods=["POST"])
                    for kind in ("responses", "files", "batches", "streams")
                ),
                Route("/v1/responses", routes.list_responses, methods=["GET"]),
                Route("/v1/responses/events", routes.list_events, methods=["GET"]),
                Route("/v1/responses/{rid}", routes.get_response),
                Route("/v1/batches", routes.list_batches, methods=["GET"]),
                Route("/v1/batches/{bid}", routes.get_batch),
                Route("/v1/batches/{bid}/cancel", routes.cancel_batch, methods=["POST"]),
                Route("/v1/batches/{bid}/{part}", routes.get_batch_part),
                Route("/v1/files/{fid}/content", routes.get_file),
                Route("/v1/streams", routes.get_streams, methods=["GET"]),
                Route("/v1/streams/{sid}", routes.get_streams),
                *self.anthropic.routes(),
            ]
        )
        return self.limits.wrap(app)

    def start(self) -> ProviderSimulator:
        config = uvicorn.Config(self._app(), log_config=None, access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        started = threading.Event()

        def serve() -> None:
            assert self._server is not None
            loop = asyncio.new_event_loop()

            async def main() -> None:
                self.creates.open()
                task = asyncio.create_task(self._server.serve(sockets=[self._sock]))  # type: ignore[union-attr]
                while not self._server.started and not task.done():  # type: ignore[union-attr]  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
                    await asyncio.sleep(0.01)
                started.set()
                await task
                await self.creates.aclose()

            loop.run_until_complete(main())
            loop.close()

        self._thread = threading.Thread(target=serve, name="provider-sim", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("provider simulator did not start")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> ProviderSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _option(value: str) -> Any:
    """A ``--batch`` option's value: a boolean, a number, or else text (``shape=guide``)."""
    if value in ("true", "false"):
        return value == "true"
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value


def main(argv: list[str] | None = None) -> None:
    """``python -m receiver.demo.simulator --port P --batch DIALECT:ID:ROWS[:option=value,...]``:
    run the simulator alone (for benchmarks) until SIGTERM."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m receiver.demo.simulator")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--batch",
        action="append",
        default=[],
        help="DIALECT:BATCH_ID:ROWS[:option=value,...] (SimBatch options)",
    )
    args = parser.parse_args(argv)
    sim = ProviderSimulator(api_key=args.api_key, port=args.port)
    for spec in args.batch:
        dialect, batch_id, rows, *rest = spec.split(":")
        options: dict[str, Any] = {}
        for pair in rest[0].split(",") if rest else []:
            name, _, value = pair.partition("=")
            options[name] = _option(value)
        sim.add_batch(dialect, batch_id, int(rows), **options)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with sim:
        print(sim.base_url, flush=True)
        while not stop.wait(0.5):
            pass


if __name__ == "__main__":  # pragma: no cover
    main()
