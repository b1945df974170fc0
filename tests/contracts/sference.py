"""sference's published API as strict models, written by us from its contract.

Source: the public repository ``s-ference/sference``, ``contract/openapi.json`` at commit
``3736ac0afd53bfb41b975ae958a07a41b04cdc1e`` (OpenAPI 3.1, ``info.version`` 0.0.1; its
inference-plane schemas are the same at ``0c91aabf29fa7367b03f16391d7d25b4144c9c6b``). Each
model below has the name and the ``required`` list of the schema it was written from.

The one shape the contract leaves free, a line of ``GET /v1/batches/{id}/results.jsonl``
(``BatchResultsResponse.results`` items are bare objects), is written from
``sdk-python/sference_sdk/models.py`` (``BatchResultRow``) at the same commit and
``docs/batches.md`` at ``1f9d27e5665a97a37b7eb5cce42a9ce9d818e99e``.

Strict beyond the contract in two ways, both on purpose (see :mod:`tests.contracts._strict`):
no object is open, and ids are UUIDs (the contract types ``id`` as a string described as
"UUID of the inference request", and every path parameter it goes into is
``format: uuid``). Timestamps are Unix seconds on responses and ISO-8601 strings everywhere
else, as the contract has them. Errors are Litestar's ``{status_code, detail, extra}``
(validation is 400, never 422).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tests.contracts._strict import IsoTime, Strict, Uuid

__all__ = [
    "BatchCreateRequest",
    "BatchListResponse",
    "BatchResponse",
    "BatchResultRow",
    "ErrorResponse",
    "InferenceRequest",
    "ResponseCreateRequest",
    "ResponseItem",
    "ResponseList",
    "ResponseListItem",
    "StreamCreateRequest",
    "StreamDetailResponse",
    "StreamListItemResponse",
    "StreamListResponse",
]

ResponseStatus = Literal["in_progress", "completed", "failed", "cancelled", "incomplete"]
"""``ResponseItem.status``: no ``queued`` and no ``pending`` (a background response starts
``in_progress``)."""
BatchStatus = Literal["pending", "running", "completed", "failed", "cancelled"]
"""``BatchResponse.status``: ``pending``, then ``running``, then one of the three ends."""
Window = Literal["24h"]
"""The only window of batches and streams (``const "24h"``)."""


# --- responses ---------------------------------------------------------------------------
class ResponseOutputText(Strict):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class ResponseOutputMessage(Strict):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["completed", "in_progress", "incomplete"] = "completed"
    content: list[ResponseOutputText]


class ResponseReasoningSummaryPart(Strict):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ResponseOutputReasoning(Strict):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[ResponseReasoningSummaryPart] = []


class ResponseFunctionToolCall(Strict):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = "{}"
    status: Literal["completed", "in_progress", "incomplete"] = "completed"


OutputItem = ResponseOutputMessage | ResponseOutputReasoning | ResponseFunctionToolCall
"""``ResponseItem.output`` items: ``oneOf`` the three (no discriminator keyword)."""


class ResponseError(Strict):
    code: str
    message: str


class ResponseIncompleteDetails(Strict):
    reason: Literal["max_output_tokens", "content_filter"]


class InputTokensDetails(Strict):
    cached_tokens: int = 0


class OutputTokensDetails(Strict):
    reasoning_tokens: int = 0


class ResponseUsage(Strict):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class ResponseItem(Strict):
    """``GET /v1/responses/{id}``, ``POST /v1/responses`` (200), ``DELETE`` (cancel). No
    ``metadata``, ``custom_id`` or ``stream_id``: the contract does not echo them."""

    id: Uuid
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: ResponseStatus
    incomplete_details: ResponseIncompleteDetails | None = None
    output: list[OutputItem] | None = None
    error: ResponseError | None = None
    usage: ResponseUsage | None = None
    service_tier: Literal["default", "flex"] = "default"


class ResponseListItem(Strict):
    id: Uuid
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: ResponseStatus


class ResponseList(Strict):
    """``GET /v1/responses?stream_id=&limit=`` (``limit`` default 100; no cursor)."""

    object: Literal["list"] = "list"
    data: list[ResponseListItem]
    has_more: bool = False


class ReasoningConfig(Strict):
    effort: str | int | None = None
    summary: str | None = None


class ResponseTextConfig(Strict):
    format: dict[str, Any] | None = None


class ResponseMetadata(Strict):
    """``ResponseCreateRequest.metadata``: the three keys the contract names."""

    completion_window: Window | None = None
    stream_id: Uuid | None = None
    custom_id: str | None = None


class ResponseCreateRequest(Strict):
    """The body of ``POST /v1/responses``, required ``[input, model]``."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | str | None = None
    max_output_tokens: int | None = None
    temperature: Annotated[float, Field(le=2.0)] | None = None
    top_p: Annotated[float, Field(le=1.0)] | None = None
    include_reasoning: bool = True
    enable_thinking: bool | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    background: bool = False
    stream: bool = False
    text: ResponseTextConfig | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    max_queue_wait_s: Annotated[int, Field(ge=5, le=300)] | None = None
    metadata: ResponseMetadata | None = None


# --- streams -----------------------------------------------------------------------------
class StreamCreateRequest(Strict):
    """The body of ``POST /v1/streams`` (answered 201 with a :class:`StreamDetailResponse`)."""

    name: Annotated[str, Field(min_length=1)]
    window: Window = "24h"


StreamStatus = Literal["open", "cancelled", "archived"]


class StreamDetailResponse(Strict):
    """``POST /v1/streams`` (201), ``GET /v1/streams/{id}``: counters of the responses
    created with ``metadata.stream_id``."""

    id: Uuid
    name: str
    window: Window
    status: StreamStatus
    created_at: IsoTime
    updated_at: IsoTime
    cancelled_at: IsoTime | None = None
    archived_at: IsoTime | None = None
    total_items: int = 0
    pending_items: int = 0
    running_items: int = 0
    completed_items: int = 0
    failed_items: int = 0
    cancelled_items: int = 0
    completion_ratio: float = 0.0
    total_prompt_tokens: int = 0
    total_completion_tokens: int = 0
    total_tokens: int = 0
    total_cost_micros: int = 0
    last_completion_at: IsoTime | None = None
    latest_completion_id: Uuid | None = None


class StreamListItemResponse(Strict):
    id: Uuid
    name: str
    window: Window
    status: StreamStatus
    created_at: IsoTime
    updated_at: IsoTime


class StreamListResponse(Strict):
    """``GET /v1/streams``: ``{items}``, no paging."""

    items: list[StreamListItemResponse]


# --- the completion feed -----------------------------------------------------------------
class StreamInferenceCompletionEvent(Strict):
    """An item of ``GET /v1/responses/events``: required ``[completion_id, status]``;
    ``result`` and ``error`` free-form objects; ``completed_at`` an ISO string."""

    completion_id: str
    status: str
    response_id: str | None = None
    custom_id: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cost_micros: int | None = None
    completed_at: IsoTime | None = None


class StreamEventListResponse(Strict):
    """``GET /v1/responses/events?stream_id=&limit=&starting_after=&ending_before=&wait_ms=``:
    required ``[data, has_more]``, no other cursor (an event's ``completion_id`` is one)."""

    object: Literal["list"] = "list"
    data: list[StreamInferenceCompletionEvent]
    has_more: bool


# --- batches -----------------------------------------------------------------------------
class InferenceRequest(Strict):
    """An item of ``BatchCreateRequest.requests``: a whole body (chat ``messages`` or
    Responses ``input``), ``custom_id`` optional."""

    custom_id: str | None = None
    body: dict[str, Any]


class BatchCreateRequest(Strict):
    """The body of ``POST /v1/batches`` (answered 201 with a :class:`BatchResponse`)."""

    window: Window = "24h"
    requests: Annotated[list[InferenceRequest], Field(min_length=1)]


class BatchResponse(Strict):
    """``POST /v1/batches`` (201), ``GET /v1/batches/{id}``, ``POST .../cancel``."""

    id: Uuid
    status: BatchStatus
    window: Window
    request_count: int
    created_at: IsoTime
    updated_at: IsoTime
    completed_at: IsoTime | None = None
    total_prompt_tokens: int = 0
    total_completion_tokens: int = 0
    total_tokens: int = 0
    total_cost_micros: int = 0


class BatchListResponse(Strict):
    """``GET /v1/batches``: ``{items}``, no paging."""

    items: list[BatchResponse]


class BatchResultRow(Strict):
    """One line of ``results.jsonl``: ``result_json`` is a chat completion."""

    custom_id: str | None = None
    status: str
    result_json: dict[str, Any] | None
    error_json: dict[str, Any] | None


# --- errors ------------------------------------------------------------------------------
class ErrorResponse(Strict):
    """Every error body (the contract's "Validation Exception" schema, Litestar's shape),
    required ``[detail, status_code]``."""

    status_code: int
    detail: str
    extra: dict[str, Any] | list[Any] | None = None
