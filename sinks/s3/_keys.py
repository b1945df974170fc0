"""The object keys of the ``s3`` sink, every one derived from the envelope it holds.

Response and batch ids are the safe ids nopoll checked before fetching them (one that is
not safe is refused, never written); a custom_id comes from provider data, so it is
percent-encoded into one key segment (:func:`key_segment`). A tenant other than
``default`` has its own folder, ``{prefix}tenant={tenant}/`` (``=`` is in no provider
name). docs/sinks/s3.md shows the layout and the encoding.
"""

from __future__ import annotations

import hashlib
import urllib.parse

from nopoll.envelope import DEFAULT_TENANT, Envelope
from nopoll.exceptions import SinkError
from nopoll.kinds import KINDS, ROW_KINDS, SINGLE_KINDS, SUMMARY_KINDS
from nopoll.wire import safe_id

__all__ = ["S3Keys", "key_segment"]

_MAX_KEY_BYTES = 1024
_MAX_SEGMENT = 200


def key_segment(text: str) -> str:
    """``text`` (a custom_id, from provider data) as one key segment: UTF-8 percent-encoded
    except ``A-Z a-z 0-9 - . _ ~``, so ``/``, ``..``, spaces, control characters and
    non-ASCII never shape the key and distinct texts never share one. An encoding over 200
    bytes is cut to 120 and followed by ``!`` and the SHA-256 of ``text`` (``!`` is always
    encoded otherwise, so a cut segment cannot equal an uncut one)."""
    encoded = urllib.parse.quote(text, safe="")
    if len(encoded) <= _MAX_SEGMENT:
        return encoded
    return f"{encoded[:120]}!{hashlib.sha256(text.encode()).hexdigest()}"


class S3Keys:
    """The keys under ``{prefix}{provider}/`` of one s3 sink (``sink`` names it in errors)."""

    def __init__(self, prefix: str, sink: str) -> None:
        self.prefix = prefix
        self.sink = sink

    def object_key(self, env: Envelope) -> str:
        """The key an envelope's object is written to: ``{plural}/{id}.json`` for a single
        result (a response), the manifest for a summary (a batch). Rows live inside parts."""
        if env.kind in SINGLE_KINDS:
            kind = KINDS[env.kind]
            folder, object_id = kind.plural, _object_id(env, kind.id_field)
            return self._key(f"{env.provider}/{folder}/{self._id(object_id)}.json", env.tenant)
        if env.kind in SUMMARY_KINDS:
            object_id = _object_id(env, KINDS[env.kind].id_field)
            return self.manifest_key(env.provider, object_id, env.tenant)
        raise SinkError(
            f"batch row {env.key!r} has no object of its own (it is a line of a part)",
            sink=self.sink,
        )

    def batch_prefix(self, provider: str, batch_id: str, tenant: str = DEFAULT_TENANT) -> str:
        """The folder of one batch's parts and manifest (ends with ``/``)."""
        return self._key(f"{provider}/batches/{self._id(batch_id)}/", tenant)

    def part_key(
        self, provider: str, batch_id: str, part: int, tenant: str = DEFAULT_TENANT
    ) -> str:
        """The key of part ``part`` of a batch: ``.../part-00000.jsonl``."""
        return f"{self.batch_prefix(provider, batch_id, tenant)}part-{part:05d}.jsonl"

    def manifest_key(self, provider: str, batch_id: str, tenant: str = DEFAULT_TENANT) -> str:
        """The key of a batch's ``_manifest.json``."""
        return f"{self.batch_prefix(provider, batch_id, tenant)}_manifest.json"

    def claim_key(self, env: Envelope) -> str:
        """Where a claim-checked body is parked: ``bodies/{key}.json``, a batch row's as
        ``bodies/{batch_id}/{key_segment(rest of its key)}.json``."""
        batch = f"{env.batch_id}/" if env.kind in ROW_KINDS and env.batch_id else None
        if batch is not None and env.key.startswith(batch):
            rest = key_segment(env.key[len(batch) :])
            return self._key(
                f"{env.provider}/bodies/{self._id(env.batch_id)}/{rest}.json", env.tenant
            )
        return self._key(f"{env.provider}/bodies/{self._id(env.key)}.json", env.tenant)

    def _id(self, value: str | None) -> str:
        """A response or batch id as a key segment: ids are checked before any fetch; one
        that is not safe (it cannot come from nopoll's own pipeline) is refused."""
        if value is None or not safe_id(value):
            raise SinkError(f"unsafe id {str(value)[:80]!r} for an object key", sink=self.sink)
        return value

    def _key(self, rest: str, tenant: str) -> str:
        folder = "" if tenant == DEFAULT_TENANT else f"tenant={tenant}/"
        key = f"{self.prefix}{folder}{rest}"
        if len(key.encode()) > _MAX_KEY_BYTES:
            raise SinkError(
                f"object key over {_MAX_KEY_BYTES} bytes: {key[:80]!r}...", sink=self.sink
            )
        return key


def _object_id(env: Envelope, field: str | None) -> str:
    """The id of an envelope's object: its kind's id field (``response_id``), else its key."""
    named: str | None = getattr(env, field) if field else None
    return named or env.key
