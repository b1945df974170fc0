"""Provider dialects: one module per provider family, one shared client.

Adding a provider is adding a module and a row in :data:`DIALECTS`.
"""

from __future__ import annotations

import importlib

from nopoll.wire import SAFE_ID, safe_id
from receiver.providers.base import BatchFetch, Dialect, ResponsesDialect
from receiver.providers.client import ProviderClient

__all__ = [
    "DIALECTS",
    "SAFE_ID",
    "BatchFetch",
    "Dialect",
    "ProviderClient",
    "ResponsesDialect",
    "dialect_for",
    "safe_id",
]

DIALECTS: dict[str, str] = {
    "openai": "receiver.providers.openai:OpenAIDialect",
    "sference": "receiver.providers.sference:SferenceDialect",
    "sail": "receiver.providers.sail:SailDialect",
    "valar": "receiver.providers.valar:ValarDialect",
    "anthropic": "receiver.providers.anthropic:AnthropicDialect",
}


def dialect_for(name: str, client: ProviderClient) -> Dialect:
    """The dialect object for a configured ``dialect:`` name."""
    module_name, _, attr = DIALECTS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    dialect: Dialect = cls(client)
    return dialect
