"""nopoll's core: what the receiver, the sinks and third-party sink plugins share.

- :mod:`nopoll.envelope`: the result envelope every sink receives, and how provider
  objects become envelopes.
- :mod:`nopoll.exceptions`: every error nopoll raises on purpose.
- :mod:`nopoll.wire`: safe ids, ``Retry-After``, webhook secrets.

It imports neither :mod:`receiver` nor :mod:`sinks`; both depend on it.
"""

from __future__ import annotations

from nopoll.envelope import SCHEMA, Envelope
from nopoll.exceptions import NopollError, SinkError, SinkRejected

__all__ = ["SCHEMA", "Envelope", "NopollError", "SinkError", "SinkRejected"]
