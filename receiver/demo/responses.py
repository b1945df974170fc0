"""What a provider returns and sends: Responses objects and signed callbacks.

:func:`make_response` builds an OpenAI Responses object; the ``*_shape`` functions serve it
in each API's own shape (a profile names which, see :mod:`receiver.demo.profiles`):
OpenAI's, sference's ``ResponseItem``, or the ``ResponseObject`` of Sail's and Valar's
references. Callbacks are signed by the ``standardwebhooks`` package, never by nopoll's own
code, so tests check nopoll's verification against an independent implementation.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from standardwebhooks.webhooks import Webhook

__all__ = [
    "generated_response",
    "make_response",
    "openai_shape",
    "pending_phase",
    "responses_object_shape",
    "send_callback",
    "sference_shape",
    "sign_callback",
]


def make_response(
    response_id: str,
    *,
    status: str = "completed",
    text: str | None = "positive",
    model: str = "sim-model-1",
    incomplete_reason: str | None = None,
    metadata: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    with_reasoning: bool = True,
) -> dict[str, Any]:
    """A Responses API object as providers return it."""
    output: list[dict[str, Any]] = []
    if with_reasoning:
        output.append({"id": f"rs_{response_id}", "type": "reasoning", "summary": []})
    if text is not None:
        output.append(
            {
                "id": f"msg_{response_id}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": True,
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": 21,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 28,
        },
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "metadata": metadata if metadata is not None else {"completion_window": "24h"},
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "error": error,
    }


def openai_shape(body: dict[str, Any], pending: str | None) -> dict[str, Any]:
    """OpenAI's Responses object; while ``pending``, no output and no usage yet."""
    if pending is None:
        return body
    return {**body, "status": pending, "output": [], "usage": None}


def sference_shape(body: dict[str, Any], pending: str | None) -> dict[str, Any]:
    """sference's ``ResponseItem``: no ``metadata`` echo, ``output`` and ``usage`` null while
    it runs, a usage with ``cached_tokens`` and ``reasoning_tokens`` details only."""
    usage = body.get("usage")
    if isinstance(usage, dict):
        usage = {
            "input_tokens": usage["input_tokens"],
            "output_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"]
            },
            "output_tokens_details": {
                "reasoning_tokens": usage["output_tokens_details"]["reasoning_tokens"]
            },
        }
    item = {
        "id": body["id"],
        "object": "response",
        "created_at": body["created_at"],
        "model": body["model"],
        "status": body["status"],
        "incomplete_details": body["incomplete_details"],
        "output": body["output"],
        "error": body["error"],
        "usage": usage,
        "service_tier": "default",
    }
    if pending is not None:
        item.update(status=pending, incomplete_details=None, output=None, error=None, usage=None)
    return item


def _zero_usage() -> dict[str, Any]:
    details = {"cached_tokens": 0, "reasoning_tokens": 0}
    return {
        "input_tokens": 0,
        "input_tokens_details": details,
        "output_tokens": 0,
        "output_tokens_details": dict(details),
        "total_tokens": 0,
    }


def responses_object_shape(body: dict[str, Any], pending: str | None) -> dict[str, Any]:
    """The ``ResponseObject`` of Sail's and Valar's references: ``metadata`` and ``usage``
    always there (zero while it runs), both usage details with ``cached_tokens`` and
    ``reasoning_tokens``; no ``background``."""
    usage = body.get("usage")
    if isinstance(usage, dict):
        usage = {
            "input_tokens": usage["input_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                "reasoning_tokens": 0,
            },
            "output_tokens": usage["output_tokens"],
            "output_tokens_details": {
                "cached_tokens": 0,
                "reasoning_tokens": usage["output_tokens_details"]["reasoning_tokens"],
            },
            "total_tokens": usage["total_tokens"],
        }
    obj = {
        "id": body["id"],
        "object": "response",
        "created_at": body["created_at"],
        "status": body["status"],
        "model": body["model"],
        "metadata": body.get("metadata") or {},
        "usage": usage or _zero_usage(),
        "output": body["output"],
        "error": body["error"],
        "incomplete_details": body["incomplete_details"],
        "parallel_tool_calls": body["parallel_tool_calls"],
        "tool_choice": body["tool_choice"],
        "tools": body["tools"],
        "store": True,
        "truncation": "disabled",
    }
    if pending is not None:
        obj.update(status=pending, output=None, error=None, incomplete_details=None)
        obj["usage"] = _zero_usage()
    return obj


def pending_phase(statuses: tuple[str, str, str], started: float, ends: float, now: float) -> str:
    """The status of a response not finished yet, ``statuses`` being (on create, in the
    first half of its wait, in the second): the first half before the midpoint of
    ``started``..``ends``, else the second."""
    return statuses[1] if now < started + (ends - started) / 2 else statuses[2]


_GENERATED_TEXTS = ("positive", "negative", "neutral")


def generated_response(response_id: str) -> dict[str, Any]:
    """The completed response an auto-responding simulator serves for an id it was never
    told about: the same body for the same id, every time."""
    digest = hashlib.sha256(response_id.encode()).digest()
    body = make_response(
        response_id,
        text=_GENERATED_TEXTS[digest[0] % len(_GENERATED_TEXTS)],
        metadata={"completion_window": "24h", "simulated": "true"},
    )
    body["created_at"] = 1_750_000_000 + int.from_bytes(digest[1:4], "big")
    return body


def sign_callback(
    secret: str | bytes, msg_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, str]:
    """Standard Webhooks headers for ``body``, signed by the standardwebhooks package.

    ``secret`` is a ``whsec_...`` string or the raw HMAC key as bytes."""
    ts = int(time.time()) if timestamp is None else timestamp
    signature = Webhook(secret).sign(msg_id, datetime.fromtimestamp(ts, tz=UTC), body.decode())
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


async def send_callback(
    client: httpx.AsyncClient,
    url: str,
    secret: str,
    response_id: str,
    *,
    event_type: str = "response.completed",
    msg_id: str | None = None,
) -> httpx.Response:
    """POST one signed ``response.*`` callback, as a provider would."""
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    body = orjson.dumps(
        {
            "id": f"evt_{uuid.uuid4().hex}",
            "type": event_type,
            "created_at": int(time.time()),
            "data": {"id": response_id},
        }
    )
    return await client.post(url, content=body, headers=sign_callback(secret, msg_id, body))
