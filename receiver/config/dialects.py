"""The provider dialects: one row per provider family, the one place their names are written.

A row says where the dialect's implementation is (``"module:Class"`` in
:mod:`receiver.providers`, imported only when used) and its simulator profile, and holds
the facts about its API that the configuration, the provider client, the CLI and the
simulator read. Adding a provider is adding its module in ``receiver/providers/`` (and a
simulator profile) and a row here. The table lives with the configuration because
``dialect:`` is a configuration key checked at load, and the configuration sits below the
providers (which read their settings from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["DIALECTS", "RETRY_STATUSES", "DialectInfo", "known_dialect"]

RETRY_STATUSES = frozenset({500, 502, 503, 504, 529})
"""The 5xx answers worth another try (beside :data:`nopoll.wire.RETRY_LATER`); 529 is
Anthropic's ``overloaded_error``, which the simulator answers in every dialect."""

RESPONSES_SAMPLE_LINE = '{"model": "m-1", "input": "hello"}'
"""A ``submit --batch`` line of an API with single responses: a Responses create body."""


@dataclass(frozen=True, slots=True)
class DialectInfo:
    """What nopoll knows about one provider family's API."""

    implementation: str
    """``"module:Class"`` of its :class:`~receiver.providers.Dialect`."""
    simulator: str
    """``"module:name"`` of its :class:`~receiver.demo.profiles.SimProfile`: how the
    provider simulator speaks its API (imported only by the simulator)."""
    sends_callbacks: bool
    """Its providers send signed callbacks (the simulator's do); else results are polled."""
    takes_webhook_secrets: bool = True
    """A provider of it may have ``webhook_secrets`` (one whose API has no callbacks at all
    takes none)."""
    completion_feed: bool = False
    """Its API has an account-wide completion feed (sference's ``GET /responses/events``):
    nopoll follows it instead of polling each id (:mod:`receiver.worker.feed`)."""
    completion_webhooks: bool = False
    """A create may carry ``metadata.completion_webhook`` and ``metadata.webhook_token``:
    the provider then POSTs the finished Response object there with ``Authorization:
    Bearer <token>`` (best effort), see :mod:`receiver.webhooks.push`."""
    takes_api_version: bool = False
    """``api_version`` is a setting of its providers (a version header)."""
    single_responses: bool = True
    """It has single background responses (``GET /responses/{id}``, ``nopoll submit``
    without ``--batch``); False: batches only."""
    base_path: str = "/v1"
    """What its ``base_url`` has after the host: OpenAI-style APIs end in ``/v1``,
    Anthropic's SDK takes the host itself."""
    rate_limit_rps: float | None = None
    """Requests per second its providers document for one account, every kind of request
    together: the default of ``providers.<name>.rate_limit_rps``. None: no fixed request
    rate is documented (a limit in tokens, or per model, or none at all), so an account
    has no request budget and its requests cost nothing extra."""
    retry_statuses: frozenset[int] = RETRY_STATUSES
    """The 5xx answers of its providers that the client tries again."""
    sample_line: str = RESPONSES_SAMPLE_LINE
    """One ``submit --batch`` line in the shape it takes, for examples (``nopoll try``)."""


_PROFILES = "receiver.demo.profiles"

DIALECTS: dict[str, DialectInfo] = {
    "openai": DialectInfo(
        "receiver.providers.openai:OpenAIDialect",
        f"{_PROFILES}:OPENAI",
        sends_callbacks=True,
    ),
    "sference": DialectInfo(
        "receiver.providers.sference:SferenceDialect",
        f"{_PROFILES}:SFERENCE",
        sends_callbacks=True,
        completion_feed=True,
    ),
    "sail": DialectInfo(
        "receiver.providers.sail:SailDialect",
        f"{_PROFILES}:SAIL",
        sends_callbacks=False,
        completion_webhooks=True,
    ),
    # Valar: 60 requests a minute per organization, summed over its API keys (Valar's
    # published limits page, limits.mdx at commit c6185994 of valarhq/docs; see docs/providers.md)
    "valar": DialectInfo(
        "receiver.providers.valar:ValarDialect",
        f"{_PROFILES}:VALAR",
        sends_callbacks=False,
        completion_webhooks=True,
        rate_limit_rps=1.0,
    ),
    "anthropic": DialectInfo(
        "receiver.providers.anthropic:AnthropicDialect",
        f"{_PROFILES}:ANTHROPIC",
        sends_callbacks=False,
        takes_webhook_secrets=False,
        takes_api_version=True,
        single_responses=False,
        base_path="",
        # a Message Batches line: its own custom_id and params
        sample_line=(
            '{"custom_id": "row-1", "params": {"model": "m-1", "max_tokens": 64, '
            '"messages": [{"role": "user", "content": "hello"}]}}'
        ),
    ),
}

_NAMES = list(DIALECTS)
_EXPECTED = ", ".join(map(repr, _NAMES[:-1])) + f" or {_NAMES[-1]!r}"


def known_dialect(value: Any) -> Any:
    """A ``dialect:`` value that names a row, else the error pydantic gives a ``Literal``
    of the names (the same type and message)."""
    if not (isinstance(value, str) and value in DIALECTS):
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}", {"expected": _EXPECTED}
        )
    return value
