"""Valar's published API as strict models, written by us from its OpenAPI reference.

Source: the public repository ``valarhq/docs`` (its docs site), ``openapi.json`` at
``main`` commit ``dc6ea0b4a0e72948165e7b67d5b7ab72cb98d231`` (``info.version`` 2026-02-18;
the file last changed in ``0a5b2c99bf722b789a4da433c1ca61fe546cb2bc``), and for the rate
limits ``limits.mdx`` at ``c6185994d2d0cbb20182f2d7c69cff6d4ba3e11a`` (branch
``mintlify/2f389b6a``, pull request 2, not merged): a leaky bucket of 60 requests a minute,
``X-RateLimit-Limit``/``-Remaining``/``-Reset`` (seconds until the bucket is full again, not
an epoch) on every answer, and 429 ``rate_limit_exceeded`` (with ``Retry-After``) or
``insufficient_quota`` (the spend cap) in ``error.type``.

Valar's ``ResponseObject``, ``ResponseUsage``, ``ResponseUsageDetails``, ``ErrorObject``,
``ErrorResponse``, ``ResponseTextConfiguration``, ``ResponseInputMessage``,
``BatchRequestItem`` and ``CreateBatchRequest``, and its inline batch objects, have the same
properties, types, patterns, limits and ``required`` lists as Sail's (compared as JSON,
descriptions aside): those models are :mod:`tests.contracts.sail`'s. Valar's own are its
``CreateResponseRequest`` (``store`` only ``true``, ``stream`` only ``false``, fewer named
fields) and its ``RequestMetadata`` (windows ``asap``, ``standard``, ``flex``: no
``priority``). Valar has no older batch shape: only the reference's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from tests.contracts._strict import Strict
from tests.contracts.sail import (
    BatchList,
    BatchRequestItem,
    BatchStatus,
    BatchSummary,
    CreateBatchRequest,
    ErrorObject,
    ErrorResponse,
    ReasoningConfiguration,
    ResponseInput,
    ResponseObject,
    ResponseUsage,
    ResponseUsageDetails,
    TextConfiguration,
)

__all__ = [
    "BatchList",
    "BatchRequestItem",
    "BatchStatus",
    "BatchSummary",
    "CreateBatchRequest",
    "CreateResponseRequest",
    "ErrorObject",
    "ErrorResponse",
    "RateLimitHeaders",
    "RateLimited",
    "ResponseObject",
    "ResponseUsage",
    "ResponseUsageDetails",
]


class RequestMetadata(Strict):
    """``metadata``: ``additionalProperties: {type: string}``, the three named keys."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, str] = Field(init=False)

    completion_window: Literal["asap", "standard", "flex"] | None = None
    completion_webhook: str | None = None
    webhook_token: str | None = None


class CreateResponseRequest(Strict):
    """The body of ``POST /v1/responses`` (and a batch item's ``params``): required
    ``[model, input]``, open (``additionalProperties: true``), metadata values strings."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: ResponseInput
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    text: TextConfiguration | None = None
    reasoning: ReasoningConfiguration | None = None
    background: bool | None = None
    prompt_cache_key: str | None = None
    store: Literal[True] | None = None
    truncation: Literal["disabled"] | None = None
    stream: Literal[False] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    metadata: RequestMetadata | None = None


class RateLimitedError(Strict):
    """A 429's ``error``: the limits page shows only ``type`` and ``message``."""

    type: Literal["rate_limit_exceeded", "insufficient_quota"]
    message: str
    param: str | None = None
    code: str | int | None = None


class RateLimited(Strict):
    """The body of a 429."""

    error: RateLimitedError


class RateLimitHeaders(Strict):
    """The limits page's headers, as integers of text (``Retry-After`` only on a 429)."""

    model_config = ConfigDict(strict=False)

    limit: Annotated[int, Field(ge=1, alias="x-ratelimit-limit")]
    remaining: Annotated[int, Field(ge=0, alias="x-ratelimit-remaining")]
    reset: Annotated[int, Field(ge=0, alias="x-ratelimit-reset")]
    retry_after: int | None = Field(default=None, ge=1, alias="retry-after")

    @classmethod
    def of(cls, headers: Any) -> RateLimitHeaders:
        """The rate-limit headers of an answer (``headers``: httpx's, any case)."""
        wanted = {name for name in (f.alias for f in cls.model_fields.values()) if name}
        found = {k.lower(): v for k, v in dict(headers).items() if k.lower() in wanted}
        return cls.model_validate(found)
