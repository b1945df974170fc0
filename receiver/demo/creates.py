"""The provider simulator's create side, as ``nopoll submit`` calls it: ``POST /v1/responses``,
``/v1/files``, ``/v1/batches`` and ``/v1/streams`` with idempotency keys and injected faults,
and Standard Webhooks callbacks announcing each created response once it completes.

Every create answers and refuses in the shape of the simulator's dialect
(:class:`~receiver.demo.profiles.SimProfile`), within the providers' documented limits
(bodies, metadata, custom_ids, at most 100,000 rows; a 400 in the dialect's error shape
names the field). An ``Idempotency-Key`` already answered replays that answer; the same
key with another body is refused. Only creations are stored.

See docs/providers.md for each provider's published create contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any, Literal, NamedTuple

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from receiver.config.dialects import DIALECTS
from receiver.demo.batches import SimBatch
from receiver.demo.feed import FeedEvents
from receiver.demo.ids import prefixed_id, uuid7
from receiver.demo.profiles import PROFILES, SimProfile
from receiver.demo.responses import make_response, send_callback
from receiver.demo.streams import SimStream, StreamItem

__all__ = ["CreateRequest", "CreateSettings", "Creations", "created_output_text"]

_ENDPOINTS = ("/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_WORDS = ("positive", "negative", "neutral")


@dataclass
class CreateSettings:
    """How the create side behaves, read on every request (set ``sim.creates.settings.x``).
    ``create_fail_first``: the share of Idempotency-Keys (by a hash of the key) whose first try
    answers ``create_fail_status`` (``Retry-After: create_retry_after`` if set): in mode ``before``
    it creates nothing, in ``after`` it creates and the retry gets the stored answer (at a
    provider without idempotency the retry creates again), in ``mixed`` half the keys do
    one and half the other. With ``webhook_url`` and ``webhook_secret``, each created
    response is announced once complete. A dialect with completion webhooks (Sail, Valar)
    POSTs each finished response whose create named ``metadata.completion_webhook`` there,
    with ``Authorization: Bearer <metadata.webhook_token>``; ``push_drop`` of them are lost."""

    dialect: str = "openai"  # the API it speaks (a name in PROFILES)
    complete_after_s: float = 0.0  # a created response or batch runs this long
    complete_after: Callable[[str], float] | None = None  # a response's own, by its id
    create_delay_s: float = 0.0  # every create answer waits this long (creation is at once)
    create_fail_first: float = 0.0
    create_fail_mode: Literal["before", "after", "mixed"] = "before"
    create_fail_status: int = 500
    create_retry_after: float | None = None
    reject_model: str | None = "reject-me"  # a create with this model: 400 does not exist
    webhook_url: str | None = None
    webhook_secret: str | None = field(default=None, repr=False)
    webhook_attempts: int = 4  # tries per callback, with backoff
    webhook_concurrency: int = 16  # callbacks in flight at most
    push_drop: float = 0.0  # the share of completion webhooks never sent (by a hash of the id)
    push_attempts: int = 4  # a completion webhook's tries: Sail and Valar retry 3 times
    push_timeout_s: float = 30.0  # each try's ceiling, as both providers document
    batch_options: dict[str, Any] = field(default_factory=dict)  # SimBatch options for all
    log_size: int = 200_000  # create requests and callback deliveries remembered

    @property
    def profile(self) -> SimProfile:
        return PROFILES[self.dialect]


class CreateRequest(NamedTuple):
    """A create request as received (``body`` None when it could not be read)."""

    path: str
    idempotency_key: str | None
    body: Any


class _Refused(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind


class CreatedResponse(NamedTuple):
    """A response the create side made: what it completes with, its metadata, and when."""

    model: str
    text: str
    metadata: dict[str, Any]
    created_at: float
    completes_at: float


_Create = Callable[[], dict[str, Any]]
_CustomIds = dict[int, str | None]


def created_output_text(input_: Any) -> str:
    """The output text a created response completes with: a word picked by a hash of its
    ``input``, then the hash's start (so different inputs get different texts)."""
    digest = hashlib.sha256(orjson.dumps(input_, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"{_WORDS[int(digest[:2], 16) % len(_WORDS)]} {digest[:12]}"


def _need(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise _Refused(message, param=param)


def _text(value: Any, where: str) -> str:
    _need(isinstance(value, str) and bool(value), f"{where}: required, a non-empty string", where)
    return str(value)


def _unique(custom_ids: Iterable[str | None], where: str) -> None:
    twice = [cid for cid, n in Counter(custom_ids).items() if cid is not None and n > 1]
    _need(not twice, f"{where}: custom_id {twice[0] if twice else ''} is not unique", where)


def _known_keys(obj: dict[str, Any], allowed: tuple[str, ...] | None, where: str) -> None:
    """``additionalProperties: false``: the first key not in ``allowed`` is refused."""
    if allowed is None:
        return
    for key in obj:
        param = f"{where}.{key}" if where else key
        _need(key in allowed, f"{param}: unknown parameter", param)


def _line(line: bytes) -> Any:
    """A JSONL line parsed; one that is not JSON stays text, a blank one is None."""
    try:
        return orjson.loads(line) if line.strip() else None
    except orjson.JSONDecodeError:
        return line.decode(errors="replace")


class Creations:
    """The create endpoints and what they created (``add_batch`` registers a batch with the
    simulator); :meth:`open` and :meth:`aclose` start and stop the callback deliveries."""

    def __init__(self, settings: CreateSettings, add_batch: Callable[..., SimBatch]) -> None:
        self.settings = settings
        self._add_batch = add_batch
        self._lock = threading.Lock()
        self._log: deque[CreateRequest] = deque(maxlen=settings.log_size)
        self.deliveries: deque[tuple[str, int, int | None]] = deque(maxlen=settings.log_size)
        """(response id, tries, last status or None) of every callback sent, newest last."""
        self._counts: Counter[str] = Counter()
        self._answers: dict[tuple[str, str | None], tuple[bytes, int, bytes]] = {}
        self._failed: set[tuple[str, str | None]] = set()
        self._responses: dict[str, CreatedResponse] = {}
        self._files: dict[str, list[tuple[str, str, str]]] = {}
        self._streams: dict[str, SimStream] = {}
        self.feed = FeedEvents()
        """The completion feed of what was created (a dialect with one: sference)."""
        self._ready: asyncio.Queue[tuple[str, bool]] | None = None
        """(response id, pushed) of each finished response to announce."""
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    def creations(self, kind: str) -> int:
        """How many ``responses``, ``files``, ``batches`` or ``streams`` were really created."""
        with self._lock:
            return self._counts[kind]

    def received(self, path_prefix: str = "") -> list[CreateRequest]:
        """The latest create requests whose path starts with ``path_prefix``, oldest first."""
        with self._lock:
            return [r for r in self._log if r.path.startswith(path_prefix)]

    def response(self, response_id: str) -> tuple[dict[str, Any], CreatedResponse] | None:
        """A created response as it is once complete (OpenAI's shape), and how it was made."""
        if (made := self._responses.get(response_id)) is None:
            return None
        body = make_response(response_id, text=made.text, model=made.model, metadata=made.metadata)
        return {**body, "created_at": int(made.created_at)}, made

    def responses(self, stream_id: str | None = None) -> list[tuple[str, CreatedResponse]]:
        """Created responses, newest first (``stream_id``: only that stream's)."""
        with self._lock:
            made = list(self._responses.items())
        made.reverse()
        if stream_id is None:
            return made
        return [(rid, m) for rid, m in made if m.metadata.get("stream_id") == stream_id]

    def stream(self, stream_id: str) -> SimStream | None:
        return self._streams.get(stream_id)

    def streams(self) -> list[SimStream]:
        """Created streams, newest first."""
        with self._lock:
            return list(reversed(self._streams.values()))

    def stream_detail(self, stream: SimStream) -> dict[str, Any]:
        items = (
            StreamItem(rid, m.created_at, m.completes_at)
            for rid, m in self.responses(stream.stream_id)
        )
        return stream.detail(items, time.time())

    def endpoint(self, kind: str) -> Callable[[Request], Awaitable[Response]]:
        """The ``POST /v1/{kind}`` endpoint, ``kind`` being ``responses``, ``files``,
        ``batches`` or ``streams`` (in the shape of ``dialect``)."""
        read = self._read_file if kind == "files" else self._read_json
        check = {
            "responses": self._response,
            "files": self._file,
            "batches": self._batch,
            "streams": self._stream,
        }[kind]

        async def create(request: Request) -> Response:
            path, key = request.url.path, request.headers.get("idempotency-key") or None
            profile = self.settings.profile
            body: dict[str, Any] | None = None
            try:
                body, digest = await read(request)
                answer = self._decide(kind, (path, key), digest, lambda: check(body or {}))
            except _Refused as refused:
                data = profile.error_body(
                    refused.status, refused.message, param=refused.param, type=refused.kind
                )
                answer = (refused.status, data, {})
            with self._lock:
                self._log.append(CreateRequest(path, key, body))
            if self.settings.create_delay_s > 0:
                await asyncio.sleep(self.settings.create_delay_s)
            return Response(answer[1], answer[0], answer[2], media_type="application/json")

        return create

    def _created_status(self, kind: str) -> int:
        profile = self.settings.profile
        return {
            "responses": profile.response_create_status,
            "batches": profile.batch_create_status,
            "streams": 201,
        }.get(kind, 200)

    def _decide(
        self, kind: str, slot: tuple[str, str | None], digest: bytes, check: Callable[[], _Create]
    ) -> tuple[int, bytes, dict[str, str]]:
        """Replay, refuse (raises), fail or create; no await here, so one key creates once."""
        key, settings, failure = slot[1], self.settings, None
        if not settings.profile.idempotency:  # the key is ignored: every create is new
            slot = (slot[0], None)
        if slot in self._answers:
            stored, status, data = self._answers[slot]
            if stored != digest:
                conflict, kind_ = settings.profile.idempotency_conflict
                message = f"Idempotency-Key {key} was used with another body"
                raise _Refused(message, conflict, kind=kind_)
            return status, data, {}
        create = check()
        share = int.from_bytes(hashlib.sha256(f"{key}".encode()).digest()[:8], "big") / 2**64
        tried = (slot[0], key)
        if key is not None and tried not in self._failed and share < settings.create_fail_first:
            self._failed.add(tried)
            retry = settings.create_retry_after
            headers = {"retry-after": f"{retry:g}"} if retry is not None else {}
            status = settings.create_fail_status
            data = settings.profile.error_body(status, "internal error, try again")
            failure = (status, data, headers)
            mode = settings.create_fail_mode
            if mode == "mixed":  # by the key: half fail before creating, half after
                mode = "before" if int(share * 2**20) % 2 else "after"
            if mode == "before":
                return failure
        data = bytes(memoryview(orjson.dumps(create())))  # orjson's own bytes keep 4 KiB
        status = self._created_status(kind)
        with self._lock:
            self._counts[kind] += 1
        if key is not None and settings.profile.idempotency:
            self._answers[slot] = (digest, status, data)
        return failure or (status, data, {})

    async def _read_json(self, request: Request) -> tuple[dict[str, Any], bytes]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise _Refused("request body is not valid JSON") from None
        _need(isinstance(body, dict), "request body must be a JSON object")
        return body, hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).digest()

    async def _read_file(self, request: Request) -> tuple[dict[str, Any], bytes]:
        """A multipart upload as ``{"purpose", "filename", "bytes", "file": [line, ...]}``."""
        raw, head = await request.body(), request.headers.get("content-type", "").encode()
        form = BytesParser(policy=HTTP).parsebytes(b"content-type: " + head + b"\r\n\r\n" + raw)
        parts = {p.get_param("name", header="content-disposition"): p for p in form.iter_parts()}
        purpose, upload = parts.get("purpose"), parts.get("file")
        purpose = purpose.get_content() if purpose is not None else None
        content = upload.get_payload(decode=True) if upload is not None else b""
        assert isinstance(content, bytes)
        file = [_line(line) for line in content.splitlines()] if upload is not None else None
        filename = upload.get_filename() if upload is not None else None
        body = {"purpose": purpose, "filename": filename, "bytes": len(content), "file": file}
        return body, hashlib.sha256(f"{purpose}\0".encode() + content).digest()

    def _new_id(self, prefix: str) -> str:
        return uuid7() if self.settings.profile.ids == "uuid" else prefixed_id(prefix)

    def _model(self, model: Any, where: str) -> str:
        model = _text(model, where)
        prefix = "" if where == "model" else f"{where}: "
        _need(model != self.settings.reject_model, f"{prefix}model {model} does not exist", where)
        return str(model)

    def _metadata(
        self, value: Any, where: str, windows: tuple[str, ...] | None, param: str | None = None
    ) -> dict[str, Any]:
        """A create's ``metadata`` checked as the dialect takes it (refusals say ``where``
        and name ``param``, default ``where``); ``windows``: the completion windows it may
        name (None: any)."""
        profile, param = self.settings.profile, param or where
        _need(isinstance(value, dict | None), f"{where}: must be an object", param)
        metadata: dict[str, Any] = dict(value or {})
        limit, count = profile.metadata_keys, len(metadata)
        _need(limit is None or count <= limit, f"{where}: at most {limit} keys, got {count}", param)
        for key, item in metadata.items():
            ok = isinstance(item, str) or (not profile.string_metadata and item is None)
            _need(ok, f"{where}.{key}: must be a string", f"{param}.{key}")
        window = metadata.get("completion_window")
        if windows is not None and window is not None:
            message = f"{where}.completion_window: must be {' or '.join(windows)}"
            _need(window in windows, message, f"{param}.completion_window")
        stream_id = metadata.get("stream_id")
        if profile.streams and stream_id is not None:
            known = isinstance(stream_id, str) and stream_id in self._streams
            _need(known, f"{where}.stream_id: no stream {stream_id}", f"{param}.stream_id")
        return metadata

    def _response(self, body: dict[str, Any]) -> _Create:
        profile = self.settings.profile
        model, input_ = self._model(body.get("model"), "model"), body.get("input")
        _need(isinstance(input_, str | list), "input: required, a string or a list", "input")
        ok = body.get("background") is True
        _need(ok, "background: must be true (background only)", "background")
        if profile.custom_id_param:
            ok = "custom_id" not in body
            _need(ok, "custom_id: unknown parameter (put it in metadata)", "custom_id")
        for name, values in profile.param_values.items():
            ok = name not in body or body[name] in values
            _need(ok, f"{name}: must be {' or '.join(map(str, values))}", name)
        metadata = self._metadata(body.get("metadata"), "metadata", profile.response_windows)
        text = created_output_text(input_)

        def create() -> dict[str, Any]:
            rid, now, after = self._new_id("resp"), time.time(), self.settings.complete_after
            delay = after(rid) if after is not None else self.settings.complete_after_s
            self._responses[rid] = CreatedResponse(model, text, metadata, now, now + delay)
            if DIALECTS[self.settings.dialect].completion_feed:
                self.feed.add(
                    rid,
                    stream_id=metadata.get("stream_id"),
                    custom_id=metadata.get("custom_id"),
                    completes_at=now + delay,
                    model=model,
                    text=text,
                )
            pushed = self._pushes(rid, metadata)
            if (self.settings.webhook_url is not None or pushed) and self._ready is not None:
                item = (rid, pushed)
                asyncio.get_running_loop().call_later(delay, self._ready.put_nowait, item)
            made = self.response(rid)
            assert made is not None
            return profile.shape_response(made[0], profile.response_statuses[0])

        return create

    def _pushes(self, rid: str, metadata: dict[str, Any]) -> bool:
        """The response is pushed when finished: its dialect has completion webhooks, its
        create named an http(s) ``completion_webhook`` (another is ignored, as documented),
        and it is not one of the ``push_drop`` share that is lost."""
        url = metadata.get("completion_webhook")
        if not DIALECTS[self.settings.dialect].completion_webhooks or not isinstance(url, str):
            return False
        if not url.startswith(("http://", "https://")):
            return False
        share = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:4], "big") / 2**32
        return share >= self.settings.push_drop

    def _stream(self, body: dict[str, Any]) -> _Create:
        profile = self.settings.profile
        if not profile.streams:
            raise _Refused(f"{self.settings.dialect} has no streams", 404)
        name = _text(body.get("name"), "name")
        window = body.get("window", "24h")
        _need(window == "24h", 'window: must be "24h" (the only supported value)', "window")

        def create() -> dict[str, Any]:
            stream = SimStream(uuid7(), name, time.time(), window)
            with self._lock:
                self._streams[stream.stream_id] = stream
            return stream.detail((), stream.created_at)

        return create

    def _file(self, body: dict[str, Any]) -> _Create:
        _need(body["purpose"] == "batch", 'purpose: must be "batch"', "purpose")
        _need(body["file"] is not None, "file: required, a JSONL file of batch requests", "file")
        rows: list[tuple[str, str, str]] = []
        for n, line in enumerate(body["file"], 1):
            where = f"file line {n}"
            if line is not None:
                _need(isinstance(line, dict), f"{where}: not a JSON object")
                cid = _text(line.get("custom_id"), f"{where}: custom_id")
                _need(line.get("method") == "POST", f'{where}: method: must be "POST"')
                url = line.get("url")
                _need(url in _ENDPOINTS, f"{where}: url: must be one of {', '.join(_ENDPOINTS)}")
                _need(isinstance(line.get("body"), dict), f"{where}: body: required, an object")
                rows.append((cid, url, _text(line["body"].get("model"), f"{where}: body.model")))
        _need(0 < len(rows) <= 50_000, f"file: 1 to 50,000 requests, got {len(rows):,}", "file")
        _unique((row[0] for row in rows), "file")

        def create() -> dict[str, Any]:
            fid, now = f"file-{uuid.uuid4().hex}", int(time.time())
            self._files[fid] = rows
            head = {"id": fid, "object": "file", "bytes": body["bytes"], "created_at": now}
            tail = {"purpose": "batch", "status": "processed", "expires_at": None}
            return {**head, "filename": body["filename"], **tail}

        return create

    def _batch(self, body: dict[str, Any]) -> _Create:
        dialect = self.settings.dialect
        profile = PROFILES[dialect]
        if profile.created_from is None:
            raise _Refused(f"{dialect} batches are not created at POST /v1/batches", 404)
        inline = profile.created_from == "requests"
        custom_ids = (
            self._inline_batch(body, profile) if inline else self._file_batch(body, profile)
        )

        def create() -> dict[str, Any]:
            options = dict(self.settings.batch_options)
            if profile.created_batch_status is not None:
                options.setdefault("pending_status", profile.created_batch_status)
            options["pending_until"] = time.time() + self.settings.complete_after_s
            options["custom_ids"] = custom_ids
            if not inline:
                options["input_file_id"] = body["input_file_id"]
                options["endpoint"] = body["endpoint"]
            if profile.label_pattern is not None and "label" in body:
                options["label"] = body["label"]
            bid = self._new_id("batch")
            return self._add_batch(dialect, bid, len(custom_ids), **options).created_object()

        return create

    def _file_batch(self, body: dict[str, Any], profile: SimProfile) -> _CustomIds:
        """The rows of a batch of an uploaded file, OpenAI's (see the module docstring)."""
        fid, endpoint = _text(body.get("input_file_id"), "input_file_id"), body.get("endpoint")
        _need(endpoint in _ENDPOINTS, f"endpoint: must be one of {', '.join(_ENDPOINTS)}")
        window = profile.windows[0]
        _need(body.get("completion_window") == window, f'completion_window: must be "{window}"')
        self._metadata(body.get("metadata"), "metadata", None)
        rows = self._files.get(fid, [])
        _need(bool(rows), f"input_file_id: no file {fid} with purpose batch")
        for n, (cid, url, model) in enumerate(rows, 1):
            where = f"input_file_id: request {n} (custom_id {cid})"
            _need(url == endpoint, f"{where}: url {url} is not the endpoint {endpoint}")
            _need(model == rows[0][2], f"{where}: one model per batch, got {model}")
        self._model(rows[0][2], "model")
        return {i: cid for i, (cid, _, _) in enumerate(rows)}

    def _inline_batch(self, body: dict[str, Any], profile: SimProfile) -> _CustomIds:
        """The rows of a batch of inline requests, sference's, Sail's or Valar's (see the
        module docstring): whole ``body`` items or Responses ``params`` (``request_part``)."""
        part, requests = profile.request_part, body.get("requests")
        whole = part == "body"  # whole bodies: the window is the batch's, custom_id optional
        _known_keys(body, profile.batch_keys, "")
        if whole:
            window = profile.windows[0]
            ok = body.get("window", window) == window
            _need(ok, f'window: must be "{window}" (the only supported value)', "window")
        else:
            ok = body.get("endpoint") == "/v1/responses"
            _need(ok, 'endpoint: must be "/v1/responses"', "endpoint")
            label = body.get("label")
            if label is not None and profile.label_pattern is not None:
                ok = isinstance(label, str) and re.fullmatch(profile.label_pattern, label)
                message = "label: letters, digits, _ and - only, at most 128 characters"
                _need(bool(ok), message, "label")
        if not isinstance(requests, list) or not requests:
            raise _Refused("requests: required, a non-empty list", param="requests")
        n_requests = len(requests)
        _need(n_requests <= 100_000, f"requests: at most 100,000, got {n_requests:,}", "requests")
        custom_ids: _CustomIds = {}
        first_model = None
        for i, row in enumerate(requests):
            where = f"requests[{i}]"
            _need(isinstance(row, dict), f"{where}: must be an object", where)
            _known_keys(row, profile.item_keys, where)
            cid = row.get("custom_id")
            cid = _text(cid, f"{where}.custom_id") if cid is not None or not whole else None
            pattern = profile.custom_id_pattern
            if cid is not None and pattern is not None:
                message = f"{where}.custom_id: lower-case letters, digits, _ and - (1 to 64)"
                _need(re.fullmatch(pattern, cid) is not None, message, f"{where}.custom_id")
            where += f' (custom_id="{cid}")' if cid is not None else ""
            param = f"requests[{i}].{part}"
            inner = row.get(part)
            _need(isinstance(inner, dict), f"{where}: {part}: required, an object", param)
            model = _text(inner.get("model"), f"{where}: {part}.model")
            input_ok = isinstance(inner.get("input"), str | list)
            if whole:
                ok = model != self.settings.reject_model
                _need(ok, f'{where}: Model "{model}" is not available for inference', param)
                expected = f'expected "{first_model}", got "{model}"'
                ok = first_model in (None, model)
                _need(ok, f"{where}: all batch rows must use the same model; {expected}", param)
                first_model, messages = model, inner.get("messages")
                ok = input_ok if messages is None else isinstance(messages, list) and bool(messages)
                _need(ok, f"{where}: body needs messages (a non-empty list) or input", param)
            else:
                self._model(model, f"{where}: params.model")
                _need(input_ok, f"{where}: params.input: required, a string or a list", param)
                meta, at = inner.get("metadata"), f"requests[{i}].params.metadata"
                self._metadata(meta, f"{where}: params.metadata", profile.windows, at)
            custom_ids[i] = cid
        _unique(custom_ids.values(), "requests")
        return custom_ids

    def open(self) -> None:
        """Start the callback deliveries (in the simulator's running event loop)."""
        self._ready, workers = asyncio.Queue(), max(1, self.settings.webhook_concurrency)
        self._tasks = [asyncio.create_task(self._deliver()) for _ in range(workers)]

    async def aclose(self) -> None:
        """Stop the callback deliveries; callbacks not sent yet are dropped."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks, self._ready = [], None
        if self._client is not None:
            await self._client.aclose()

    async def _deliver(self) -> None:
        """POST a signed ``response.completed`` event for each response that completes,
        retrying a failure a bounded number of times with the same webhook-id (or, pushed,
        the finished Response object with the create's bearer token)."""
        while self._ready is not None:
            (rid, pushed), msg_id = await self._ready.get(), f"msg_{uuid.uuid4().hex}"
            client = self._client = self._client or httpx.AsyncClient(timeout=5, trust_env=False)
            if pushed:
                attempts, status = await self._push(client, rid)
                with self._lock:
                    self.deliveries.append((rid, attempts, status))
                continue
            attempts, status = 0, None
            while attempts < self.settings.webhook_attempts and not 200 <= (status or 0) < 300:
                url, secret = self.settings.webhook_url, self.settings.webhook_secret
                if url is None or secret is None:
                    break
                await asyncio.sleep(min(2.0, 0.05 * 2**attempts) if attempts else 0)
                attempts, status = attempts + 1, None
                with contextlib.suppress(httpx.HTTPError):
                    answer = await send_callback(client, url, secret, rid, msg_id=msg_id)
                    status = answer.status_code
            with self._lock:
                self.deliveries.append((rid, attempts, status))

    async def _push(self, client: httpx.AsyncClient, rid: str) -> tuple[int, int | None]:
        """One completion webhook: the finished Response object, as ``GET`` answers it, to
        its create's URL with its token; a non-2xx or a failed try is tried again, up to
        ``push_attempts`` tries in all. (tries, last status or None)."""
        made = self.response(rid)
        if made is None:
            return 0, None
        body, created = made
        url, token = created.metadata["completion_webhook"], created.metadata.get("webhook_token")
        headers = {"content-type": "application/json"}
        if isinstance(token, str) and token:
            headers["authorization"] = f"Bearer {token}"
        content = orjson.dumps(self.settings.profile.shape_response(body, None))
        attempts, status = 0, None
        while attempts < self.settings.push_attempts and not 200 <= (status or 0) < 300:
            await asyncio.sleep(min(2.0, 0.05 * 2**attempts) if attempts else 0)
            attempts, status = attempts + 1, None
            with contextlib.suppress(httpx.HTTPError):
                answer = await client.post(
                    url, content=content, headers=headers, timeout=self.settings.push_timeout_s
                )
                status = answer.status_code
        return attempts, status
