"""``nopoll simulate`` and ``nopoll send-test``: try nopoll against your own instance."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
