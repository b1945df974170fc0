"""The ``anthropic`` dialect: Anthropic's Message Batches API.

No callbacks: a batch is watched until its ``processing_status`` is ``ended``; its rows
are the JSONL at ``results_url``, fetched only from ``base_url``'s own scheme, host and
port. The results come in no stable order, so a resumed batch is rewritten from its first
row (:attr:`AnthropicDialect.stable_chunks`). The create side of ``nopoll submit --batch``
is :func:`batch_request` (one file line as one request) and :func:`split` (into batches
under the API's limits, each recorded as ``batch:<part>``).

See docs/batches.md (Anthropic Message Batches) and docs/submit.md (Anthropic Message
Batches).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import orjson

from nopoll.envelope import BatchFacts, BatchRow, BodyFields
from nopoll.exceptions import ProviderError
from nopoll.status import pending_status, row_status, unknown_status
from nopoll.wire import safe_id
from receiver.providers.base import (
    BadCallback,
    BatchFetch,
    Callback,
    Chunk,
    IdempotentCreates,
    chunk_rows,
    count_or_none,
    line_object,
)
from receiver.providers.batch_input import MAX_LISTED, BadLine, BatchInput, CreateCall
from receiver.providers.client import ProviderClient

__all__ = [
    "API_VERSION",
    "BATCHES_PATH",
    "MAX_BATCH_BYTES",
    "MAX_REQUESTS",
    "AnthropicDialect",
    "auth_headers",
    "batch_request",
    "create_body",
    "message_output_text",
    "parse_line",
    "split",
]

API_VERSION = "2026-10-21"
"""The ``anthropic-version`` the official Python SDK sends (with a Bearer token)."""
_BEARER_SINCE = "2026-10-21"
BATCHES_PATH = "v1/messages/batches"
MAX_REQUESTS = 100_000
"""Requests one Message Batch holds at most."""
MAX_BATCH_BYTES = 256 * 1024 * 1024
"""The largest create body the API takes (256 MB)."""
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def auth_headers(api_key: str | None, version: str | None) -> dict[str, str]:
    """The headers every request carries: ``anthropic-version`` and the key, as a Bearer
    token (the SDK's way, from 2026-10-21) or as ``x-api-key`` (older versions)."""
    version = version or API_VERSION
    headers = {"anthropic-version": version}
    if api_key is not None:
        if version >= _BEARER_SINCE:
            headers["authorization"] = f"Bearer {api_key}"
        else:
            headers["x-api-key"] = api_key
    return headers


def _error_of(result: dict[str, Any]) -> dict[str, Any]:
    """``{code, message}`` from an errored result's ``{"type": "error", "error": {...}}``."""
    outer = result.get("error")
    inner = outer.get("error") if isinstance(outer, dict) else None
    inner = inner if isinstance(inner, dict) else outer if isinstance(outer, dict) else {}
    code, message = inner.get("type"), inner.get("message")
    return {
        "code": code if isinstance(code, str) else "error",
        "message": message if isinstance(message, str) else "the request errored",
    }


def parse_line(index: int, line: bytes) -> BatchRow:
    """One line of a Message Batch's results."""
    parsed = line_object(index, line)
    if isinstance(parsed, BatchRow):
        return parsed
    data, custom_id = parsed
    result = data.get("result")
    if not isinstance(result, dict):
        error = {"code": "bad_line", "message": "the line has no result object"}
        return BatchRow(index, custom_id, "failed", error=error)
    kind = result.get("type")
    status = row_status(kind)
    if kind == "succeeded":
        message = result.get("message")
        if isinstance(message, dict):
            return BatchRow(index, custom_id, status, body=message)
        error = {"code": "no_message", "message": "a succeeded result without its message"}
        return BatchRow(index, custom_id, "failed", error=error)
    if kind == "errored":
        return BatchRow(index, custom_id, status, error=_error_of(result))
    return BatchRow(index, custom_id, status, error=unknown_status(kind))


def message_output_text(message: dict[str, Any]) -> str | None:
    """The text of a Messages object: its ``text`` content blocks, concatenated (other
    blocks, such as ``tool_use`` or ``thinking``, carry no output text)."""
    parts = [
        block["text"]
        for block in message.get("content") or ()
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    ]
    return "".join(parts) if parts else None


class AnthropicDialect(IdempotentCreates):
    """Anthropic Message Batches: poll the batch, then stream ``results_url``; a ``submit
    --batch`` file becomes as many batches as the API's limits need (see the module docs)."""

    max_requests: ClassVar[int] = MAX_REQUESTS
    max_bytes: ClassVar[int] = MAX_BATCH_BYTES
    whole_file_record: ClassVar[str | None] = None
    stable_chunks: ClassVar[bool] = False
    """Results come in no particular order, another one on each download: a resumed batch
    is rewritten from its first row."""

    def __init__(self, client: ProviderClient) -> None:
        self.client = client
        key = client.config.api_key
        client.authenticate(
            auth_headers(key.get_secret_value() if key else None, client.config.api_version)
        )

    async def fetch_response(
        self, response_id: str, *, wait_s: float | None = None
    ) -> dict[str, Any]:
        raise ProviderError(
            "the anthropic dialect has batches only (no single responses to fetch)",
            provider=self.client.name,
            path="responses/?",
        )

    async def fetch_batch_object(
        self, batch_id: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """``GET {base_url}/v1/messages/batches/{id}`` (after checking the id is safe)."""
        if not safe_id(batch_id):
            raise ProviderError("unsafe batch id", provider=self.client.name, path=BATCHES_PATH)
        path = f"{BATCHES_PATH}/{batch_id}"
        data = await self.client.get_json(path, attempts=attempts, wait_s=wait_s)
        if data.get("id") != batch_id:
            raise ProviderError(
                "answer is for another batch id", provider=self.client.name, path=path, status=200
            )
        return data

    @classmethod
    def parse_callback(cls, event: dict[str, Any]) -> Callback | None:
        """Never: Anthropic's API sends no callbacks (its providers take no webhook secrets,
        so none reaches a dialect)."""
        raise BadCallback("the anthropic dialect takes no callbacks")

    @classmethod
    def normalize(cls, body: dict[str, Any] | None) -> BodyFields:
        """A Messages object: its text blocks, its usage, and output cut at ``max_tokens``
        as nopoll's ``incomplete`` (``max_output_tokens``), so the same usable rule holds."""
        if not body or body.get("type") != "message" or "content" not in body:
            return BodyFields()
        raw_usage = body.get("usage")
        usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        model = body.get("model")
        cut = body.get("stop_reason") == "max_tokens"
        return BodyFields(
            output_text=message_output_text(body),
            input_tokens=count_or_none(usage.get("input_tokens")),
            output_tokens=count_or_none(usage.get("output_tokens")),
            model=model if isinstance(model, str) else None,
            incomplete_reason="max_output_tokens" if cut else None,
            status="incomplete" if cut else None,
        )

    def object_status(self, obj: dict[str, Any]) -> Any:
        """A Message Batch's ``processing_status`` (it has no ``status``)."""
        status = obj.get("status")
        return obj.get("processing_status") if status is None else status

    def batch_pending(self, batch: dict[str, Any]) -> str | None:
        """By ``processing_status``: only ``ended`` is over."""
        return pending_status(self.object_status(batch), "batch")

    def batch_facts(self, batch: dict[str, Any]) -> BatchFacts:
        """An ended Message Batch has no status of its own: ``cancelled`` once a cancel was
        initiated (``cancel_initiated_at``), as OpenAI's cancelled batches are; ``expired``
        when every request it counts expired; else ``completed``."""
        facts = BatchFacts.of(batch)
        counts = facts.request_counts
        if batch.get("cancel_initiated_at"):
            return dataclasses.replace(facts, status="cancelled")
        ended = sum(n for k, n in counts.items() if k != "processing")
        if counts.get("expired") and counts["expired"] == ended:
            return dataclasses.replace(facts, status="expired")
        return facts

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = batch = await self.fetch_batch_object(fetch.batch_id)
        if batch.get("processing_status") != "ended":
            return  # not over yet: the runner retries the job later
        path = f"{BATCHES_PATH}/{fetch.batch_id}"
        if batch.get("archived_at"):
            raise ProviderError(
                f"the results were archived at {str(batch['archived_at'])[:40]} and are gone "
                "(Anthropic keeps them 29 days)",
                provider=self.client.name,
                path=path,
                status=200,
            )
        url = batch.get("results_url")
        if not isinstance(url, str) or not url:
            raise ProviderError(
                "the ended batch has no results_url", provider=self.client.name, path=path
            )
        if not self.client.on_origin(url):
            raise ProviderError(
                "results_url is not on base_url's scheme, host and port: refused (nopoll "
                "sends the API key to the configured host only)",
                provider=self.client.name,
                path=path,
                status=200,
            )
        async for chunk in chunk_rows(self.client.stream_lines(url), fetch, parse_line):
            yield chunk

    @classmethod
    def batch_input(cls, lines: Iterable[tuple[int, bytes]], dialect: str) -> BatchInput:
        """Every line checked (:func:`batch_request`, custom_ids unique across the file,
        each request within a whole batch's bytes); the lines are kept, to be read again
        by :meth:`create_calls` (a one-shot iterator is kept in memory)."""
        if iter(lines) is lines:
            lines = list(lines)
        batch = BatchInput(lines=lines)
        seen: dict[str, int] = {}
        for number, item, custom_id, error in _requests(lines):
            if item is not None and custom_id is not None:
                first = seen.setdefault(custom_id, number)
                if first != number:
                    error = f"custom_id: {custom_id} is also on line {first}"
                elif len(item) + _ENVELOPE > cls.max_bytes:
                    error = (
                        f"the request is larger than a whole batch may be ({cls.max_bytes:,} bytes)"
                    )
            if error is None:
                batch.rows += 1
                continue
            batch.problems += 1
            if len(batch.rejected) < MAX_LISTED:
                batch.rejected.append(BadLine(number, custom_id, error))
        if not batch.rows and not batch.rejected:
            batch.rejected.append(BadLine(0, None, "the file holds no lines"))
            batch.problems += 1
        return batch

    def create_calls(
        self, batch: BatchInput, name: str, digest: str, created: Mapping[str, str]
    ) -> Iterator[CreateCall]:
        """``POST /v1/messages/batches`` for each part of the file, in file order, built
        only when it is sent (one part in memory at a time)."""
        items = (item for _, item, _, _ in _requests(batch.lines) if item is not None)
        groups = split(items, max_requests=self.max_requests, max_bytes=self.max_bytes)
        for part, group in enumerate(groups):
            yield CreateCall(f"batch:{part}", BATCHES_PATH, create_body(group))


# --- the create side: nopoll submit --batch ---------------------------------------------

_CHAT_KEPT = {"temperature": "temperature", "top_p": "top_p", "stop": "stop_sequences"}
"""Chat completion fields carried over as Messages parameters (under their names there)."""
_CHAT_DROPPED = {"model", "messages", "max_tokens", "max_completion_tokens", *_CHAT_KEPT}


def _content(value: Any, where: str) -> tuple[Any, str | None]:
    """A chat message's content as Messages content: a string, or its text parts."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        blocks = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return None, f"{where}: a {kind!s:.40} part has no Messages equivalent here"
            blocks.append({"type": "text", "text": part.get("text")})
        return blocks, None
    return None, f"{where}: must be a string or a list of text parts"


def _chat_params(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A chat completion body as Messages ``params``, or why it cannot be one."""
    extra = sorted(k for k in body if k not in _CHAT_DROPPED)
    if extra:
        return None, f"body.{extra[0]}: has no Messages equivalent (nopoll does not guess)"
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return None, "body.max_tokens: required by Anthropic, a positive integer"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, "body.messages: must be a non-empty list"
    params: dict[str, Any] = {"model": body["model"], "max_tokens": max_tokens}
    system: list[Any] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(message, dict):
            return None, f"{where}: must be an object"
        role = message.get("role")
        content, error = _content(message.get("content"), f"{where}.content")
        if error is not None:
            return None, error
        if role in ("system", "developer"):
            if turns:
                return None, f"{where}: a {role} message after the conversation started"
            system.append(content)
        elif role in ("user", "assistant"):
            if set(message) - {"role", "content"}:
                name = sorted(set(message) - {"role", "content"})[0]
                return None, f"{where}.{name}: has no Messages equivalent"
            turns.append({"role": role, "content": content})
        else:
            return None, f"{where}.role: {str(role)[:20]!r} has no Messages equivalent"
    if not turns:
        return None, "body.messages: no user or assistant message"
    if system:
        texts = [s if isinstance(s, str) else "".join(b["text"] for b in s) for s in system]
        params["system"] = "\n\n".join(texts)
    params["messages"] = turns
    for name, target in _CHAT_KEPT.items():
        if name in body:
            value = body[name]
            params[target] = [value] if name == "stop" and isinstance(value, str) else value
    return params, None


def batch_request(row: Any) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """One line of a ``submit --batch`` file as a Message Batch request: ``(request,
    custom_id, error)``. Native lines are ``{"custom_id", "params"}`` (sent as they are);
    OpenAI batch-input lines ``{"custom_id", "method", "url": "/v1/chat/completions",
    "body"}`` have their chat body turned into ``params``."""
    if not isinstance(row, dict):
        return None, None, "not a JSON object"
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
        return None, None, "custom_id: 1 to 64 characters of a-z, A-Z, 0-9, _ and -"
    if "params" in row:
        params = row["params"]
        extra = sorted(set(row) - {"custom_id", "params"})
        if extra:
            return None, custom_id, f"{extra[0]}: a native line has custom_id and params only"
        if not isinstance(params, dict):
            return None, custom_id, "params: must be an object"
        for name in ("model", "max_tokens", "messages"):
            if name not in params:
                return None, custom_id, f"params.{name}: required"
        return {"custom_id": custom_id, "params": params}, custom_id, None
    if row.get("method") != "POST":
        return None, custom_id, 'method: must be "POST" (or give a native "params" line)'
    if row.get("url") != "/v1/chat/completions":
        return None, custom_id, "url: only /v1/chat/completions lines become Messages requests"
    body = row.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return None, custom_id, "body.model: must be a non-empty string"
    params, error = _chat_params(body)
    if params is None:
        return None, custom_id, error
    return {"custom_id": custom_id, "params": params}, custom_id, None


_HEAD = b'{"requests":['
_TAIL = b"]}"
_ENVELOPE = len(_HEAD + _TAIL)


def _requests(
    lines: Iterable[tuple[int, bytes]],
) -> Iterator[tuple[int, bytes | None, str | None, str | None]]:
    """``(line number, serialized request or None, custom_id, error)`` for every line."""
    for number, raw in lines:
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            yield number, None, None, "not JSON"
            continue
        request, custom_id, error = batch_request(row)
        yield number, (orjson.dumps(request) if request is not None else None), custom_id, error


def split(
    items: Iterable[bytes],
    *,
    max_requests: int = MAX_REQUESTS,
    max_bytes: int = MAX_BATCH_BYTES,
) -> Iterator[list[bytes]]:
    """Serialized requests in groups whose create body (``{"requests":[...]}``) stays
    within ``max_requests`` requests and ``max_bytes`` bytes, in file order."""
    group: list[bytes] = []
    size = len(_HEAD) + len(_TAIL)
    for item in items:
        grown = size + len(item) + (1 if group else 0)
        if group and (len(group) >= max_requests or grown > max_bytes):
            yield group
            group, grown = [], len(_HEAD) + len(_TAIL) + len(item)
        group.append(item)
        size = grown
    if group:
        yield group


def create_body(group: list[bytes]) -> bytes:
    """``POST /v1/messages/batches``'s body for one group of serialized requests."""
    return _HEAD + b",".join(group) + _TAIL
