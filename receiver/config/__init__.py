"""The nopoll configuration: one typed :class:`Settings`, loaded once at start-up by
:func:`load_settings` (see :mod:`receiver.config.settings`)."""

from receiver.config.dialects import DIALECTS, DialectInfo
from receiver.config.sections import (
    ApiConfig,
    HttpConfig,
    RetryConfig,
    WatchConfig,
)
from receiver.config.settings import (
    WEBHOOK_DIALECTS,
    ProviderConfig,
    RouteConfig,
    Settings,
    load_settings,
)
from receiver.config.source import is_secret_key, redact_url
from receiver.config.tenants import ConsumerToken

__all__ = [
    "DIALECTS",
    "WEBHOOK_DIALECTS",
    "ApiConfig",
    "ConsumerToken",
    "DialectInfo",
    "HttpConfig",
    "ProviderConfig",
    "RetryConfig",
    "RouteConfig",
    "Settings",
    "WatchConfig",
    "is_secret_key",
    "load_settings",
    "redact_url",
]
