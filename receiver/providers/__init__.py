"""Provider dialects: one module per provider family, one shared client.

Adding a provider is adding a module and a row in :data:`DIALECTS` (the table of
:mod:`receiver.config.dialects`, which the configuration checks ``dialect:`` against).
"""

from __future__ import annotations

import importlib

from nopoll.wire import SAFE_ID, safe_id
from receiver.config.dialects import DIALECTS
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
    "dialect_type",
    "safe_id",
]


def dialect_type(name: str) -> type[Dialect]:
    """The dialect class for a configured ``dialect:`` name (its module imported now)."""
    module_name, _, attr = DIALECTS[name].implementation.partition(":")
    cls: type[Dialect] = getattr(importlib.import_module(module_name), attr)
    return cls


def dialect_for(name: str, client: ProviderClient) -> Dialect:
    """The dialect object for a configured ``dialect:`` name."""
    return dialect_type(name)(client)
