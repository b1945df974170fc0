"""The ``openai`` (and any OpenAI-compatible API) dialect.

Single responses are fetched as every dialect does (:class:`ResponsesDialect`); see
DESIGN.md's dialect table for how this provider hands out batch results.
"""

from __future__ import annotations

from receiver.providers.base import ResponsesDialect

__all__ = ["OpenAIDialect"]


class OpenAIDialect(ResponsesDialect):
    """OpenAI: ``GET {base_url}/responses/{id}`` for single responses."""
