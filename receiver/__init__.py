"""nopoll's service: the webhook API, the workers, the provider dialects, the CLI.

The public surface is what ``__all__`` names; submodules load on first use, so importing
``receiver`` costs nothing and the command line starts quickly.

- :func:`load_settings`, :class:`Settings`: the configuration (``receiver.config.settings``).
- :func:`create_app`: the ASGI app (``receiver.app``).
- :func:`run`: the API and/or workers until SIGTERM (``receiver.runtime``).
- :func:`build_workers`: the arq workers of one process (``receiver.worker.process``).
- :func:`build_state`, :class:`WorkerState`: what every job needs (``receiver.worker.state``).

The result envelope and the errors live in :mod:`nopoll`; sinks in :mod:`sinks`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Settings",
    "WorkerState",
    "build_state",
    "build_workers",
    "create_app",
    "load_settings",
    "run",
]

_WHERE = {
    "Settings": "receiver.config.settings",
    "load_settings": "receiver.config.settings",
    "create_app": "receiver.app",
    "run": "receiver.runtime",
    "build_workers": "receiver.worker.process",
    "build_state": "receiver.worker.state",
    "WorkerState": "receiver.worker.state",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'receiver' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
