"""Sail's published API as strict models, written by us from its OpenAPI reference.

Source: Sail's ``openapi.json`` (``info.version`` 2026-02-18, published at
``https://docs.sailresearch.com/openapi.json``) as the public repository
``api-evangelist/sail-research`` keeps it: ``openapi/_original/sail-research-openapi-original.json``
at commit ``e4c671581744d7fbcbadc596a87fa24f8d158eb0``, split per tag in
``openapi/sail-research-batches-api-api-openapi.yml`` and
``openapi/sail-research-responses-api-api-openapi.yml`` at
``2bfaed7c36cfae5bb52030685d8495c68e4e6591`` (the same schemas). Each model has the name and
the ``required`` list of the schema it was written from; the batch objects are inline
schemas there, named here after their operations.

:class:`GuideBatch` is the older shape of Sail's "Sending requests at scale" guide
(its requests-at-scale page): a top-level ``status``, a
``request_counts`` object and inline ``results`` (or ``results: null`` and an ``error``).
nopoll must read both; the reference shape has no ``status`` and no ``results``.

Strict beyond the reference on purpose (see :mod:`tests.contracts._strict`): the objects it
leaves open (``ResponseObject``, the batch objects, ``ErrorObject``) are closed here, and
``request_status`` entries are held to the five values Sail's documents use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from tests.contracts._strict import Strict

__all__ = [
    "BatchList",
    "BatchRequestItem",
    "BatchStatus",
    "BatchSummary",
    "CreateBatchRequest",
    "CreateResponseRequest",
    "ErrorObject",
    "ErrorResponse",
    "GuideBatch",
    "ResponseObject",
    "ResponseUsage",
    "ResponseUsageDetails",
]

CustomId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", min_length=1, max_length=64)]
Label = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=128)]
RowStatus = Literal["COMPLETED", "FAILED", "CANCELLED", "RUNNING", "PENDING"]
"""A ``request_status`` entry's ``status`` (the reference types it as a string)."""
ResponseStatus = Literal["pending", "running", "failed", "completed", "cancelled"]


# --- batches -----------------------------------------------------------------------------
class BatchRequestItem(Strict):
    """``additionalProperties: false``, required ``[custom_id, params]``; ``params`` is a
    Responses create body (open)."""

    custom_id: CustomId
    params: dict[str, Any]


class CreateBatchRequest(Strict):
    """The body of ``POST /v1/batches``: ``additionalProperties: false``, required
    ``[endpoint, requests]``; custom_ids unique within the batch (its description)."""

    endpoint: Literal["/v1/responses"]
    requests: Annotated[list[BatchRequestItem], Field(min_length=1, max_length=100_000)]
    label: Label | None = None

    @model_validator(mode="after")
    def _unique_custom_ids(self) -> CreateBatchRequest:
        seen: set[str] = set()
        for item in self.requests:
            if item.custom_id in seen:
                raise ValueError(f"custom_id {item.custom_id} is not unique")
            seen.add(item.custom_id)
        return self


class BatchSummary(Strict):
    """``POST /v1/batches`` (200) and each item of ``GET /v1/batches``: required
    ``[id, request_counts, created_at]``; ``request_counts`` is the total, an integer."""

    id: str
    request_counts: int
    created_at: int
    label: Label | None = None


BatchList = list[BatchSummary]
"""``GET /v1/batches?after_id=&before_id=&limit=``: a bare array (``limit`` 1-200,
default 25)."""


class RequestStatus(Strict):
    status: RowStatus


class BatchStatus(Strict):
    """``GET /v1/batches/{id}``: required ``[id, request_counts, created_at,
    request_status]``; no ``status``, no ``results``. The batch is done when every entry
    is ``COMPLETED``, ``FAILED`` or ``CANCELLED``."""

    id: str
    request_counts: int
    created_at: int
    label: Label | None = None
    request_status: dict[str, RequestStatus]


class GuideCounts(Strict):
    total: int
    completed: int
    failed: int


class GuideResultBody(Strict):
    body: ResponseObject


class GuideResult(Strict):
    """An item of the guide's ``results``: either ``response.body`` or ``error``."""

    custom_id: str
    response: GuideResultBody | None
    error: dict[str, Any] | None


class GuideError(Strict):
    message: str


class GuideBatch(Strict):
    """The guide's ``GET /v1/batches/{id}``: the reference object (the guide refers to it
    for the full shape) with ``status``, a counts object, and ``results`` (null when too
    large to inline, with ``error.message`` saying so)."""

    id: str
    status: Literal["in_progress", "completed"]
    created_at: int
    label: Label | None = None
    request_counts: GuideCounts
    request_status: dict[str, RequestStatus]
    results: list[GuideResult] | None = None
    error: GuideError | None = None


# --- responses ---------------------------------------------------------------------------
class ResponseUsageDetails(Strict):
    """Both ``input_tokens_details`` and ``output_tokens_details``: closed, each with both
    counts."""

    cached_tokens: int
    reasoning_tokens: int


class ResponseUsage(Strict):
    """``additionalProperties: false``."""

    input_tokens: int
    input_tokens_details: ResponseUsageDetails
    output_tokens: int
    output_tokens_details: ResponseUsageDetails
    total_tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class InputTextPart(Strict):
    type: Literal["input_text"]
    text: str


class InputImagePart(Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputMessage(Strict):
    """``ResponseInputMessage``: ``additionalProperties: false``."""

    role: Literal["system", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[InputTextPart | InputImagePart], Field(min_length=1)]
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None


class InputObject(Strict):
    messages: Annotated[list[InputMessage], Field(min_length=1)]


ResponseInput = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[InputMessage], Field(min_length=1)]
    | InputObject
)


class TextFormat(Strict):
    type: Literal["text"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfiguration(Strict):
    format: TextFormat | JsonSchemaFormat


class ResponseObject(Strict):
    """``GET /v1/responses/{id}``, ``POST /v1/responses`` (202 when ``background``),
    ``GET /v1/batches/{id}/{custom_id}``: required ``[id, object, created_at, status,
    model, metadata, usage]`` (``usage`` even while pending)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
    model: str
    metadata: dict[str, Any]
    usage: ResponseUsage
    input: ResponseInput | None = None
    output: str | list[dict[str, Any]] | dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfiguration | None = None
    store: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    truncation: str | dict[str, Any] | None = None
    user: str | None = None


class RequestMetadata(Strict):
    """``metadata``: ``additionalProperties: {type: string}``, the three named keys."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, str] = Field(init=False)

    completion_window: Literal["asap", "priority", "standard", "flex"] | None = None
    completion_webhook: str | None = None
    webhook_token: str | None = None


class ReasoningConfiguration(Strict):
    model_config = ConfigDict(extra="allow")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class CreateResponseRequest(Strict):
    """The body of ``POST /v1/responses`` (and a batch item's ``params``): required
    ``[model, input]``, open (``additionalProperties: true``), metadata values strings."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: ResponseInput
    raw_prompt_tokens: (
        Annotated[
            list[Annotated[int, Field(ge=0, le=2_147_483_647)]],
            Field(min_length=1, max_length=2_000_000),
        ]
        | None
    ) = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    text: TextConfiguration | None = None
    reasoning: ReasoningConfiguration | None = None
    instructions: str | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    background: bool | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    truncation: Literal["disabled"] | None = None
    stream: bool | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    metadata: RequestMetadata | None = None


# --- errors ------------------------------------------------------------------------------
class ErrorObject(Strict):
    """Required ``[message, type]``; validation refusals are ``invalid_request_error``."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Strict):
    """Every error body: ``{"error": ErrorObject}``, ``additionalProperties: false``."""

    error: ErrorObject


GuideResultBody.model_rebuild()
