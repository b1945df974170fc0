"""The ``s3`` sink: results as objects in S3 or any S3 API (MinIO, moto), via aiobotocore.

:class:`S3Sink` writes under ``{prefix}{provider}/`` a response as
``responses/{id}.json``, a batch as numbered ``part-NNNNN.jsonl`` chunks and a
``_manifest.json`` written last, and Kafka claim-check bodies under ``bodies/``. Every key
is derived from the envelope (:mod:`sinks.s3._keys`), so a rerun overwrites. The S3 calls,
their errors and multipart uploads are :mod:`sinks.s3._client`.

See docs/sinks/s3.md (layout, manifest, credentials).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from nopoll.envelope import DEFAULT_TENANT, Envelope
from nopoll.exceptions import SinkError
from nopoll.kinds import ROW_KINDS, SINGLE_KINDS, SUMMARY_KINDS
from sinks.base import SinkBase
from sinks.s3._client import S3Calls
from sinks.s3._keys import S3Keys, key_segment
from sinks.s3.config import MIB, S3SinkConfig

__all__ = ["MANIFEST_SCHEMA", "S3Sink", "S3SinkConfig", "key_segment"]

MANIFEST_SCHEMA = "nopoll.s3-manifest/v1"
_PART_NAME = re.compile(r"(\d{5,})\.jsonl")
_REMEMBERED_PARTS = 10_000


class S3Sink(SinkBase):
    """Writes envelopes as S3 objects with deterministic keys."""

    config_model = S3SinkConfig
    config: S3SinkConfig
    keys: S3Keys
    """Every object key of this sink."""

    def __init__(self, name: str, config: S3SinkConfig) -> None:
        super().__init__(name, config)
        self.keys, self._calls = S3Keys(config.prefix, name), S3Calls(name, config)
        self._parts: dict[str, tuple[str, int]] = {}
        """Part key → (ETag, rows) of the parts this sink wrote whose batch has no
        manifest yet (at most ``_REMEMBERED_PARTS``)."""

    def object_key(self, env: Envelope) -> str:
        """A response's object, or a batch summary's manifest (see :class:`S3Keys`)."""
        return self.keys.object_key(env)

    def batch_prefix(self, provider: str, batch_id: str, tenant: str = DEFAULT_TENANT) -> str:
        return self.keys.batch_prefix(provider, batch_id, tenant)

    def part_key(
        self, provider: str, batch_id: str, part: int, tenant: str = DEFAULT_TENANT
    ) -> str:
        return self.keys.part_key(provider, batch_id, part, tenant)

    def manifest_key(self, provider: str, batch_id: str, tenant: str = DEFAULT_TENANT) -> str:
        return self.keys.manifest_key(provider, batch_id, tenant)

    def claim_key(self, env: Envelope) -> str:
        """Where :meth:`put_claim` parks an envelope's body."""
        return self.keys.claim_key(env)

    async def open(self) -> None:
        await self._calls.open()

    async def aclose(self) -> None:
        await self._calls.aclose()

    @property
    def client(self) -> Any:
        """The open aiobotocore S3 client."""
        return self._calls.client

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        """Response objects side by side, then the manifest of each batch summary."""
        rows = [e for e in envelopes if e.kind in ROW_KINDS]
        if rows:
            raise SinkError(
                f"batch rows ({rows[0].key!r} and {len(rows) - 1} more) must come through "
                "write_batch_part(part, envelopes): the s3 sink writes rows as numbered parts",
                sink=self.name,
            )
        objects = [(self.object_key(e), e.to_json()) for e in envelopes if e.kind in SINGLE_KINDS]
        await self._calls.bounded(lambda item: self._put(*item, "application/json"), objects)
        for env in envelopes:
            if env.kind in SUMMARY_KINDS:
                await self._write_manifest(env)

    async def write_batch_part(self, part: int, envelopes: Sequence[Envelope]) -> None:
        """Write one numbered chunk of a batch's rows as ``part-{part:05d}.jsonl``."""
        if part < 0:
            raise SinkError(f"part number must be >= 0, not {part}", sink=self.name)
        if not envelopes:
            return
        first = envelopes[0]
        if first.batch_id is None:
            raise SinkError(f"batch row {first.key!r} has no batch_id", sink=self.name)
        for env in envelopes:
            if env.kind not in ROW_KINDS or (env.provider, env.batch_id, env.tenant) != (
                first.provider,
                first.batch_id,
                first.tenant,
            ):
                raise SinkError(
                    f"part {part} of {first.provider}/{first.batch_id} got {env.kind} "
                    f"{env.provider}/{env.key}: a part holds one batch's rows only",
                    sink=self.name,
                )
        body = _jsonl(envelopes)
        key = self.part_key(first.provider, first.batch_id, part, first.tenant)
        metadata = {"rows": str(len(envelopes))}
        if len(body) > self.config.multipart_threshold_bytes:
            etag = await self._calls.put_multipart(key, body, "application/x-ndjson", metadata)
        else:
            etag = await self._put(key, body, "application/x-ndjson", metadata)
        self._remember_part(key, etag, len(envelopes))

    def _remember_part(self, key: str, etag: str, rows: int) -> None:
        """A part this sink wrote: its manifest need not ask S3 for its row count."""
        if not etag:
            return
        self._parts.pop(key, None)  # the latest write last, so the oldest go first
        self._parts[key] = (etag, rows)
        while len(self._parts) > _REMEMBERED_PARTS:
            del self._parts[next(iter(self._parts))]

    async def put_claim(self, env: Envelope) -> str:
        """Park ``env.body`` as its own object; returns its ``s3://bucket/key`` URL."""
        key = self.claim_key(env)
        await self._put(key, orjson.dumps(env.body), "application/json")
        return f"s3://{self.config.bucket}/{key}"

    async def _put(
        self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None
    ) -> str:
        return await self._calls.put(key, body, content_type, metadata)

    # -- the manifest -------------------------------------------------------------------

    async def _write_manifest(self, summary: Envelope) -> None:
        batch_id = summary.batch_id or summary.key
        parts = await self._list_parts(summary.provider, batch_id, summary.tenant)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "provider": summary.provider,
            "batch_id": batch_id,
            "status": summary.status,
            "rows": sum(p["rows"] for p in parts),
            "counts": summary.metadata.get("rows_by_status"),
            "parts": parts,
            "summary": summary.to_dict(),
        }
        body = orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n"
        key = self.manifest_key(summary.provider, batch_id, summary.tenant)
        await self._put(key, body, "application/json")
        for part in parts:
            self._parts.pop(part["key"], None)

    async def _list_parts(self, provider: str, batch_id: str, tenant: str) -> list[dict[str, Any]]:
        """Every ``part-*.jsonl`` of a batch with its key, row count and size, in order."""
        prefix = f"{self.batch_prefix(provider, batch_id, tenant)}part-"
        found: list[tuple[int, str, int, str]] = []
        with self._calls.errors("ListObjectsV2", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
                for obj in page.get("Contents", ()):
                    match = _PART_NAME.fullmatch(obj["Key"][len(prefix) :])
                    if match:
                        part = (int(match.group(1)), obj["Key"], int(obj["Size"]))
                        found.append((*part, str(obj.get("ETag", ""))))
        found.sort()
        # A part this sink wrote, still as it wrote it (the same ETag), has its row count
        # here; the others (written by another worker, another run, by hand) are asked.
        rows = await self._calls.bounded(
            self._rows_of, [(key, etag, self._parts.get(key)) for _, key, _, etag in found]
        )
        return [
            {"key": key, "rows": n, "bytes": size}
            for (_, key, size, _), n in zip(found, rows, strict=True)
        ]

    async def _rows_of(self, part: tuple[str, str, tuple[str, int] | None]) -> int:
        key, etag, written = part
        if written is not None and written[0] == etag:
            return written[1]
        return await self._part_rows(key)

    async def _part_rows(self, key: str) -> int:
        with self._calls.errors("HeadObject", key):
            head = await self.client.head_object(Bucket=self.config.bucket, Key=key)
        raw = (head.get("Metadata") or {}).get("rows")
        if raw is not None and str(raw).isdigit():
            return int(raw)
        # A part without the metadata (written by hand or another tool): count its lines.
        with self._calls.errors("GetObject", key):
            response = await self.client.get_object(Bucket=self.config.bucket, Key=key)
            lines = 0
            async with response["Body"] as stream:
                while chunk := await stream.read(MIB):
                    lines += chunk.count(b"\n")
        return lines


def _jsonl(envelopes: Sequence[Envelope]) -> bytes:
    """One JSON line per envelope. Each line is a copy of orjson's output, which is freed at
    once: keeping orjson's own bytes (over-allocated, then shrunk) until the join took
    twice the page faults and 15 MB more RSS per part."""
    return b"".join(env.to_json() + b"\n" for env in envelopes)
