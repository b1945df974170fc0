"""The provider simulator's Anthropic Message Batches routes (the ``anthropic`` dialect).

It creates batches under ``/v1/messages/batches``, checked as the API does; answers the
MessageBatch object (``in_progress``, ``canceling``, ``ended`` with its ``results_url``);
cancels; and streams the JSONL results row by row in a new order on each download, as
the API promises no order. It authenticates as the API does (``anthropic-version``, a
Bearer key from 2026-10-21, else ``x-api-key``) and errs in its shape. Faults: 429 and
529 answers, a download that breaks off, archived results, a results URL on another host.

See docs/batches.md (Anthropic Message Batches).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from receiver.demo.answers import answer, json_answer

__all__ = ["AnthropicBatch", "AnthropicBatches", "anthropic_error"]

_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_BEARER_SINCE = "2026-10-21"
_MAX_REQUESTS = 100_000
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str, retry_after: float | None = None) -> Response:
    """An error answer in the API's shape."""
    kind = _ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    headers = {"retry-after": f"{retry_after:g}"} if retry_after is not None else None
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=UTC).isoformat().replace("+00:00", "Z")


@dataclass
class AnthropicBatch:
    """A Message Batch the simulator serves; each row follows from its index."""

    batch_id: str
    n_rows: int
    in_progress_polls: int = 0
    """The first N ``GET``s of the batch find it ``in_progress``."""
    in_progress_until: float | None = None
    """Unix time before which it is ``in_progress`` (unless canceled)."""
    canceling_polls: int = 0
    """After a cancel (or ``cancel_after_polls``), N ``GET``s find it ``canceling``."""
    cancel_after_polls: int | None = None
    """Cancel the batch by itself once it has been polled this many times."""
    errored_every: int = 0
    expired_every: int = 0
    max_tokens_every: int = 0
    """Every k-th row stopped at ``max_tokens`` (its text cut short)."""
    canceled_every: int = 3
    """Once canceled, every k-th row was canceled (never processed)."""
    fail_times: int = 0
    """The first N ``GET``s of the batch answer ``fail_status``."""
    fail_status: int = 429
    results_fail_times: int = 0
    """The first N ``GET``s of the results answer ``results_fail_status``."""
    results_fail_status: int = 429
    results_break_after: int | None = None
    """The first results download breaks off after this many rows (the connection drops
    before the answer ends)."""
    retry_after: float | None = 0.2
    archived: bool = False
    """Results archived (29 days on): ``archived_at`` set, the results gone."""
    results_origin: str | None = None
    """Give a results URL on this origin (``scheme://host:port``) instead of the API's."""
    body_bytes: int = 0
    """Extra text in each answer, to make rows as large as real ones."""
    texts: list[str] | None = None
    """Created batches: each row's answer text (else ``answer {i}``)."""
    custom_ids: list[str] | None = None
    model: str = "claude-sim-1"
    created_at: float = field(default_factory=time.time)
    cancel_initiated_at: float | None = None
    ended_at: float | None = None
    polls: int = 0
    canceling_served: int = 0
    results_served: int = 0
    results_broken: bool = False

    def custom_id(self, i: int) -> str:
        return self.custom_ids[i] if self.custom_ids is not None else f"row-{i:06d}"

    # --- where the batch is -------------------------------------------------------------
    def poll(self) -> str:
        """Count one GET of the batch and say its ``processing_status`` now."""
        self.polls += 1
        if self.cancel_after_polls is not None and self.polls > self.cancel_after_polls:
            self.cancel()
        if self.ended_at is not None:
            return "ended"
        if self.cancel_initiated_at is not None:
            if self.canceling_served < self.canceling_polls:
                self.canceling_served += 1
                return "canceling"
            return self._end()
        running = self.polls <= self.in_progress_polls or (
            self.in_progress_until is not None and time.time() < self.in_progress_until
        )
        return "in_progress" if running else self._end()

    def cancel(self) -> None:
        if self.cancel_initiated_at is None and self.ended_at is None:
            self.cancel_initiated_at = time.time()

    def _end(self) -> str:
        self.ended_at = time.time()
        return "ended"

    def result_type(self, i: int) -> str:
        every = self.canceled_every if self.cancel_initiated_at is not None else 0
        if every and i % every == every - 1:
            return "canceled"
        if self.errored_every and i % self.errored_every == self.errored_every - 1:
            return "errored"
        if self.expired_every and i % self.expired_every == self.expired_every - 2:
            return "expired"
        return "succeeded"

    def counts(self, ended: bool) -> dict[str, int]:
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if not ended:
            counts["processing"] = self.n_rows
            return counts
        for i in range(self.n_rows):
            counts[self.result_type(i)] += 1
        return counts

    def batch_object(self, status: str, api_origin: str) -> dict[str, Any]:
        ended = status == "ended"
        results_url = None
        if ended:
            origin = self.results_origin or api_origin
            results_url = f"{origin}/v1/messages/batches/{self.batch_id}/results"
        return {
            "id": self.batch_id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": self.counts(ended),
            "created_at": _rfc3339(self.created_at),
            "expires_at": _rfc3339(self.created_at + 86_400),
            "ended_at": _rfc3339(self.ended_at) if ended else None,
            "cancel_initiated_at": _rfc3339(self.cancel_initiated_at),
            "archived_at": _rfc3339(self.created_at + 29 * 86_400) if self.archived else None,
            "results_url": results_url,
        }

    # --- results ------------------------------------------------------------------------
    def text(self, i: int) -> str:
        base = self.texts[i] if self.texts is not None else f"answer {i}"
        pad = ("lorem ipsum " * (self.body_bytes // 12 + 1))[: self.body_bytes]
        return base + (f" {pad}" if pad else "")

    def message(self, i: int) -> dict[str, Any]:
        cut = self.max_tokens_every and i % self.max_tokens_every == self.max_tokens_every - 1
        return {
            "id": f"msg_{self.batch_id}_{i}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": self.text(i)}],
            "stop_reason": "max_tokens" if cut else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 4},
        }

    def line(self, i: int) -> dict[str, Any]:
        kind = self.result_type(i)
        result: dict[str, Any] = {"type": kind}
        if kind == "succeeded":
            result["message"] = self.message(i)
        elif kind == "errored":
            result["error"] = {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": f"row {i}: bad params"},
            }
        return {"custom_id": self.custom_id(i), "result": result}

    def order(self, download: int = 1) -> list[int]:
        """Results come in an order of their own, never the input order, and another one on
        each download (the ``download``-th answer of the results)."""
        ids = list(range(self.n_rows))
        random.Random(f"{self.batch_id}/{download}").shuffle(ids)
        return ids

    def result_lines(self, download: int = 1) -> Iterator[bytes]:
        for i in self.order(download):
            yield orjson.dumps(self.line(i)) + b"\n"


def _check_request(i: int, item: Any, seen: set[str]) -> str | None:
    where = f"requests.{i}"
    if not isinstance(item, dict):
        return f"{where}: must be an object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not _CUSTOM_ID.match(custom_id):
        return f"{where}.custom_id: must be 1-64 characters of [a-zA-Z0-9_-]"
    if custom_id in seen:
        return f"{where}.custom_id: {custom_id} is not unique within the batch"
    seen.add(custom_id)
    extra = sorted(set(item) - {"custom_id", "params"})
    if extra:
        return f"{where}.{extra[0]}: Extra inputs are not permitted"
    params = item.get("params")
    if not isinstance(params, dict):
        return f"{where}.params: Field required"
    if not isinstance(params.get("model"), str) or not params["model"]:
        return f"{where}.params.model: Field required"
    max_tokens = params.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return f"{where}.params.max_tokens: must be a positive integer"
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        return f"{where}.params.messages: must be a non-empty list"
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return f"{where}.params.messages.{j}.role: must be user or assistant"
    return None


class AnthropicBatches:
    """The routes and their batches; ``count`` and ``api_keys`` are the simulator's."""

    def __init__(
        self,
        count: Callable[[Request], None],
        api_keys: frozenset[str] | None,
        *,
        complete_after_s: Callable[[], float] = lambda: 0.0,
        created_text: Callable[[Any], str] | None = None,
    ) -> None:
        self._count = count
        self._api_keys = api_keys
        self._complete_after_s = complete_after_s
        self._created_text = created_text or (lambda _: "ok")
        self._lock = threading.Lock()
        self.batches: dict[str, AnthropicBatch] = {}
        self.create_fail_times = 0
        """The next N creates answer ``create_fail_status`` (529 overloaded) first."""
        self.create_fail_status = 529
        self.created: list[str] = []
        """Ids of the batches ``POST /v1/messages/batches`` created, oldest first."""
        self.received: deque[tuple[str | None, Any]] = deque(maxlen=1000)
        """(Idempotency-Key, body) of the latest create requests, oldest first."""
        self._answers: dict[str, bytes] = {}

    def add(self, batch_id: str, n_rows: int, **options: Any) -> AnthropicBatch:
        batch = AnthropicBatch(batch_id=batch_id, n_rows=n_rows, **options)
        with self._lock:
            self.batches[batch_id] = batch
        return batch

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages/batches", self._guard(self.create), methods=["POST"]),
            Route("/v1/messages/batches/{bid}", self._guard(self.get)),
            Route("/v1/messages/batches/{bid}/cancel", self._guard(self.cancel), methods=["POST"]),
            Route("/v1/messages/batches/{bid}/results", self._guard(self.results)),
        ]

    def _guard(self, endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            self._count(request)
            refused = self._refused(request)
            if refused is not None:
                return refused
            result: Response = await endpoint(request)
            return result

        return guarded

    def _refused(self, request: Request) -> Response | None:
        version = request.headers.get("anthropic-version")
        if not version:
            return anthropic_error(400, "anthropic-version: header is required")
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        key = request.headers.get("x-api-key")
        if scheme == "Bearer" and bearer:
            if version < _BEARER_SINCE:
                return anthropic_error(
                    401, f"Bearer authentication needs anthropic-version {_BEARER_SINCE} or later"
                )
            key = bearer
        if self._api_keys is not None and key not in self._api_keys:
            return anthropic_error(401, "invalid x-api-key")
        return None

    def _batch(self, request: Request) -> AnthropicBatch | None:
        with self._lock:
            return self.batches.get(request.path_params["bid"])

    @staticmethod
    def _origin(request: Request) -> str:
        url = request.url
        return f"{url.scheme}://{url.netloc}"

    async def create(self, request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        raw = await request.body()
        with self._lock:
            if self.create_fail_times > 0:
                self.create_fail_times -= 1
                return anthropic_error(self.create_fail_status, "Overloaded", retry_after=0.1)
            if key is not None and key in self._answers:
                return Response(self._answers[key], media_type="application/json")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return anthropic_error(400, "the body is not JSON")
        with self._lock:
            self.received.append((key, body))
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not requests:
            return anthropic_error(400, "requests: must be a non-empty list")
        if len(requests) > _MAX_REQUESTS:
            return anthropic_error(400, f"requests: at most {_MAX_REQUESTS:,} per batch")
        seen: set[str] = set()
        for i, item in enumerate(requests):
            error = _check_request(i, item, seen)
            if error is not None:
                return anthropic_error(400, error)
        batch_id = "msgbatch_" + uuid.uuid4().hex[:24]
        batch = AnthropicBatch(
            batch_id=batch_id,
            n_rows=len(requests),
            custom_ids=[item["custom_id"] for item in requests],
            texts=[self._created_text(item["params"]["messages"]) for item in requests],
            model=requests[0]["params"]["model"],
            in_progress_until=time.time() + self._complete_after_s(),
            canceled_every=0,
        )
        data = orjson.dumps(batch.batch_object("in_progress", self._origin(request)))
        with self._lock:
            self.batches[batch_id] = batch
            self.created.append(batch_id)
            if key is not None:
                self._answers[key] = data
        return Response(data, media_type="application/json")

    async def get(self, request: Request) -> Response:
        batch = self._batch(request)
        if batch is None:
            return anthropic_error(404, "no such message batch")
        with self._lock:
            if batch.fail_times > 0:
                batch.fail_times -= 1
                status = batch.fail_status
                message = "Overloaded" if status == 529 else "Rate limited"
                return anthropic_error(status, message, batch.retry_after)
            status_now = batch.poll()
            obj = batch.batch_object(status_now, self._origin(request))
        return json_answer(obj)

    async def cancel(self, request: Request) -> Response:
        batch = self._batch(request)
        if batch is None:
            return anthropic_error(404, "no such message batch")
        with self._lock:
            batch.cancel()
            status = "ended" if batch.ended_at is not None else "canceling"
            obj = batch.batch_object(status, self._origin(request))
        return json_answer(obj)

    async def results(self, request: Request) -> Response:
        batch = self._batch(request)
        if batch is None:
            return anthropic_error(404, "no such message batch")
        with self._lock:
            if batch.ended_at is None:
                return anthropic_error(400, "the batch is still processing: no results yet")
            if batch.archived:
                return anthropic_error(404, "the batch's results were archived")
            batch.results_served += 1
            download = batch.results_served
            if download <= batch.results_fail_times:
                status = batch.results_fail_status
                message = "Overloaded" if status == 529 else "Rate limited"
                return anthropic_error(status, message, batch.retry_after)
            cut = None if batch.results_broken else batch.results_break_after
            batch.results_broken = batch.results_broken or cut is not None
        await asyncio.sleep(0)
        lines = batch.result_lines(download)
        if cut is not None:
            return StreamingResponse(_broken_off(lines, cut), media_type="application/jsonl")
        return answer(lines, media_type="application/jsonl")


class _DroppedConnection(Exception):
    """Raised mid-answer: the server closes the connection before the answer's end."""


async def _broken_off(lines: Iterator[bytes], rows: int) -> AsyncIterator[bytes]:
    """The first ``rows`` lines, then the connection dropped mid-answer, half a second later
    (a client drops what it has received but not read yet when the connection breaks: the
    pause lets it read them all)."""
    yield b"".join(itertools.islice(lines, rows))
    await asyncio.sleep(0.5)
    raise _DroppedConnection(f"the simulator drops the results download after {rows} rows")
