"""The status page, ``/ui`` (see :mod:`receiver.ui.app`)."""

from __future__ import annotations

from receiver.ui.app import MAX_FORM, ui_routes

__all__ = ["MAX_FORM", "ui_routes"]
