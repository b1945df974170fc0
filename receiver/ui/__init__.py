"""The status page, ``/ui`` (see :mod:`receiver.ui.app`)."""

from __future__ import annotations

from receiver.ui.app import ui_routes

__all__ = ["ui_routes"]
