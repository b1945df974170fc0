"""The ``s3`` sink: results as objects in S3 or any S3 API (MinIO, moto), via aiobotocore.

Layout under ``{prefix}{provider}/``:

- ``responses/{response_id}.json``: one response envelope as a JSON object;
- ``batches/{batch_id}/part-00000.jsonl``, ``part-00001.jsonl``, ...: a batch's rows, one
  envelope per line, one object per numbered chunk (object metadata ``rows``);
- ``batches/{batch_id}/_manifest.json``: written last, from the summary envelope, listing
  every part with its row count;
- ``bodies/{key}.json``: a body parked for the Kafka sink's claim check (a batch row's
  ``{batch_id}/{custom_id}`` with the custom_id part percent-encoded as one segment).

Every key is derived from the envelope, so a rerun overwrites instead of duplicating.
Response and batch ids are the safe ids nopoll checked before fetching them; a custom_id
comes from provider data, so it is percent-encoded (:func:`key_segment`).
Credentials come from the standard AWS chain unless the config gives keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from typing import Any, Literal, TypeVar

import orjson
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import ClientError, NoCredentialsError
from pydantic import Field, SecretStr, field_validator, model_validator

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError
from nopoll.wire import safe_id
from sinks.base import SinkBase, SinkConfig

__all__ = ["MANIFEST_SCHEMA", "S3Sink", "S3SinkConfig", "key_segment"]

log = logging.getLogger("nopoll.sinks.s3")

MANIFEST_SCHEMA = "nopoll.s3-manifest/v1"
MIB = 1024 * 1024
_MIN_PART = 5 * MIB  # S3's smallest part (all but the last)
_MAX_PART = 5 * 1024 * MIB
_MAX_PARTS = 10_000
_MAX_KEY_BYTES = 1024
_T = TypeVar("_T")
_R = TypeVar("_R")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PART_NAME = re.compile(r"(\d{5,})\.jsonl")
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


class S3SinkConfig(SinkConfig):
    """``{type: s3, bucket: llm-results, prefix: nopoll/, endpoint_url: http://minio:9000}``."""

    type: Literal["s3"] = "s3"
    bucket: str
    prefix: str = ""
    """Prepended to every key as is: ``nopoll/`` gives ``nopoll/<provider>/...``."""
    endpoint_url: str | None = None
    """An S3-compatible endpoint (MinIO, moto); AWS's own when unset."""
    region: str | None = None
    """AWS region; from the standard chain (``AWS_REGION``, ``~/.aws/config``) when unset."""
    access_key_id: SecretStr | None = None
    """Static keys; by default the standard AWS chain (environment, profile, IAM role)."""
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    multipart_threshold_bytes: int = Field(default=8 * MIB, ge=1)
    """A part object larger than this is sent as a multipart upload."""
    multipart_part_bytes: int = Field(default=8 * MIB, ge=_MIN_PART, le=_MAX_PART)
    create_bucket: bool = False
    """Create the bucket on open when it does not exist (handy for MinIO and tests)."""
    max_attempts: int = Field(default=3, ge=1, le=10)
    """Attempts per S3 request (botocore's standard retry mode) before the write fails."""
    concurrency: int = Field(default=8, ge=1, le=64)
    """S3 requests one write may run at once (response objects, upload parts, HEADs)."""

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        problem = _bucket_problem(value)
        if problem:
            raise ValueError(f"{value!r} is not a valid S3 bucket name: {problem}")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if value.startswith("/"):
            raise ValueError("must not start with '/' (S3 keys have no leading slash)")
        if len(value.encode()) > 512:
            raise ValueError("must be at most 512 bytes")
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @model_validator(mode="after")
    def _keys(self) -> S3SinkConfig:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(
                "give both access_key_id and secret_access_key, or neither "
                "(then the standard AWS credential chain is used)"
            )
        return self


def _bucket_problem(name: str) -> str | None:
    """Why ``name`` breaks S3's bucket naming rules, or None."""
    if not 3 <= len(name) <= 63:
        return "must be 3 to 63 characters"
    if not _BUCKET.match(name):
        return (
            "use lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
        )
    if ".." in name or ".-" in name or "-." in name:
        return "no '..', '.-' or '-.'"
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(name)
        return "must not look like an IP address"
    if name.startswith(("xn--", "sthree-", "amzn-s3-demo-")):
        return "reserved prefix"
    if name.endswith(("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")):
        return "reserved suffix"
    return None


class S3Sink(SinkBase):
    """Writes envelopes as S3 objects with deterministic keys."""

    config_model = S3SinkConfig
    config: S3SinkConfig

    def __init__(self, name: str, config: S3SinkConfig) -> None:
        super().__init__(name, config)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._checksum: dict[str, str] = {}

    # -- keys ---------------------------------------------------------------------------

    def object_key(self, env: Envelope) -> str:
        """The key an envelope's object is written to: the response object for
        ``response``, the manifest for ``batch``. Batch rows live inside parts."""
        if env.kind == "response":
            return self._key(
                f"{env.provider}/responses/{self._id(env.response_id or env.key)}.json"
            )
        if env.kind == "batch":
            return self.manifest_key(env.provider, env.batch_id or env.key)
        raise SinkError(
            f"batch row {env.key!r} has no object of its own (it is a line of a part)",
            sink=self.name,
        )

    def batch_prefix(self, provider: str, batch_id: str) -> str:
        """The folder of one batch's parts and manifest (ends with ``/``)."""
        return self._key(f"{provider}/batches/{self._id(batch_id)}/")

    def part_key(self, provider: str, batch_id: str, part: int) -> str:
        """The key of part ``part`` of a batch: ``.../part-00000.jsonl``."""
        return f"{self.batch_prefix(provider, batch_id)}part-{part:05d}.jsonl"

    def manifest_key(self, provider: str, batch_id: str) -> str:
        """The key of a batch's ``_manifest.json``."""
        return f"{self.batch_prefix(provider, batch_id)}_manifest.json"

    def claim_key(self, env: Envelope) -> str:
        """Where :meth:`put_claim` parks an envelope's body: ``bodies/{key}.json``, a batch
        row's as ``bodies/{batch_id}/{key_segment(rest of its key)}.json``."""
        batch = f"{env.batch_id}/" if env.kind == "batch_row" and env.batch_id else None
        if batch is not None and env.key.startswith(batch):
            rest = key_segment(env.key[len(batch) :])
            return self._key(f"{env.provider}/bodies/{self._id(env.batch_id)}/{rest}.json")
        return self._key(f"{env.provider}/bodies/{self._id(env.key)}.json")

    def _id(self, value: str | None) -> str:
        """A response or batch id as a key segment: ids are checked before any fetch; one
        that is not safe (it cannot come from nopoll's own pipeline) is refused."""
        if value is None or not safe_id(value):
            raise SinkError(f"unsafe id {str(value)[:80]!r} for an object key", sink=self.name)
        return value

    def _key(self, rest: str) -> str:
        key = f"{self.config.prefix}{rest}"
        if len(key.encode()) > _MAX_KEY_BYTES:
            raise SinkError(
                f"object key over {_MAX_KEY_BYTES} bytes: {key[:80]!r}...", sink=self.name
            )
        return key

    # -- lifecycle ----------------------------------------------------------------------

    async def open(self) -> None:
        if self._client is not None:
            return
        cfg = self.config
        keys: dict[str, str] = {}
        if cfg.access_key_id is not None and cfg.secret_access_key is not None:
            keys["aws_access_key_id"] = cfg.access_key_id.get_secret_value()
            keys["aws_secret_access_key"] = cfg.secret_access_key.get_secret_value()
            if cfg.session_token is not None:
                keys["aws_session_token"] = cfg.session_token.get_secret_value()
        boto_config = AioConfig(
            connect_timeout=min(cfg.timeout_s, 10.0),
            read_timeout=cfg.timeout_s,
            retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
            s3={"addressing_style": cfg.addressing_style},
            max_pool_connections=max(10, cfg.concurrency),
        )
        stack = AsyncExitStack()
        try:
            with self._errors("create client", ""):
                self._client = await stack.enter_async_context(
                    get_session().create_client(
                        "s3",
                        region_name=cfg.region,
                        endpoint_url=cfg.endpoint_url,
                        config=boto_config,
                        **keys,
                    )
                )
            self._stack = stack
            if getattr(self._client.meta.config, "request_checksum_calculation", None) == (
                "when_supported"
            ):
                self._checksum = {"ChecksumAlgorithm": "CRC32"}
            await self._ensure_bucket()
        except BaseException:
            self._client = None
            self._stack = None
            await stack.aclose()
            raise

    async def _ensure_bucket(self) -> None:
        bucket = self.config.bucket
        try:
            await self._client.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("403", "AccessDenied", "Forbidden"):
                # A write-only policy (no s3:ListBucket) cannot check; the writes will tell.
                log.warning("cannot check bucket %s (access denied); going on", bucket)
                return
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise self._sink_error("HeadBucket", "", exc) from exc
        except Exception as exc:
            raise self._sink_error("HeadBucket", "", exc) from exc
        if not self.config.create_bucket:
            raise SinkError(
                f"bucket {bucket!r} does not exist (create it, or set create_bucket: true)",
                sink=self.name,
            )
        region = self.config.region or self._client.meta.region_name
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if region and region not in ("us-east-1", "aws-global"):
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            await self._client.create_bucket(**kwargs)
            log.info("created bucket %s", bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._sink_error("CreateBucket", "", exc) from exc
        except Exception as exc:
            raise self._sink_error("CreateBucket", "", exc) from exc

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def client(self) -> Any:
        """The open aiobotocore S3 client."""
        if self._client is None:
            raise SinkError("not open", sink=self.name)
        return self._client

    # -- writes -------------------------------------------------------------------------

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        """Response objects side by side, then the manifest of each batch summary."""
        rows = [e for e in envelopes if e.kind == "batch_row"]
        if rows:
            raise SinkError(
                f"batch rows ({rows[0].key!r} and {len(rows) - 1} more) must come through "
                "write_batch_part(part, envelopes): the s3 sink writes rows as numbered parts",
                sink=self.name,
            )
        objects = [
            (self.object_key(e), orjson.dumps(e.to_dict()))
            for e in envelopes
            if e.kind == "response"
        ]
        await self._bounded(lambda item: self._put(*item, "application/json"), objects)
        for env in envelopes:
            if env.kind == "batch":
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
            if env.kind != "batch_row" or (env.provider, env.batch_id) != (
                first.provider,
                first.batch_id,
            ):
                raise SinkError(
                    f"part {part} of {first.provider}/{first.batch_id} got {env.kind} "
                    f"{env.provider}/{env.key}: a part holds one batch's rows only",
                    sink=self.name,
                )
        body = b"".join(orjson.dumps(e.to_dict()) + b"\n" for e in envelopes)
        key = self.part_key(first.provider, first.batch_id, part)
        metadata = {"rows": str(len(envelopes))}
        if len(body) > self.config.multipart_threshold_bytes:
            await self._put_multipart(key, body, "application/x-ndjson", metadata)
        else:
            await self._put(key, body, "application/x-ndjson", metadata)

    async def put_claim(self, env: Envelope) -> str:
        """Park ``env.body`` as its own object; returns its ``s3://bucket/key`` URL."""
        key = self.claim_key(env)
        await self._put(key, orjson.dumps(env.body), "application/json")
        return f"s3://{self.config.bucket}/{key}"

    async def _write_manifest(self, summary: Envelope) -> None:
        batch_id = summary.batch_id or summary.key
        parts = await self._list_parts(summary.provider, batch_id)
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
        await self._put(self.manifest_key(summary.provider, batch_id), body, "application/json")

    async def _list_parts(self, provider: str, batch_id: str) -> list[dict[str, Any]]:
        """Every ``part-*.jsonl`` of a batch with its key, row count and size, in order."""
        prefix = f"{self.batch_prefix(provider, batch_id)}part-"
        found: list[tuple[int, str, int]] = []
        with self._errors("ListObjectsV2", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
                for obj in page.get("Contents", ()):
                    match = _PART_NAME.fullmatch(obj["Key"][len(prefix) :])
                    if match:
                        found.append((int(match.group(1)), obj["Key"], int(obj["Size"])))
        found.sort()
        rows = await self._bounded(self._part_rows, [key for _, key, _ in found])
        return [
            {"key": key, "rows": n, "bytes": size}
            for (_, key, size), n in zip(found, rows, strict=True)
        ]

    async def _part_rows(self, key: str) -> int:
        with self._errors("HeadObject", key):
            head = await self.client.head_object(Bucket=self.config.bucket, Key=key)
        raw = (head.get("Metadata") or {}).get("rows")
        if raw is not None and str(raw).isdigit():
            return int(raw)
        # A part without the metadata (written by hand or another tool): count its lines.
        with self._errors("GetObject", key):
            response = await self.client.get_object(Bucket=self.config.bucket, Key=key)
            lines = 0
            async with response["Body"] as stream:
                while chunk := await stream.read(MIB):
                    lines += chunk.count(b"\n")
        return lines

    # -- S3 calls -----------------------------------------------------------------------

    async def _put(
        self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None
    ) -> None:
        with self._errors("PutObject", key):
            await self.client.put_object(
                Bucket=self.config.bucket,
                Key=key,
                Body=body,
                ContentType=content_type,
                Metadata=metadata or {},
            )

    async def _put_multipart(
        self, key: str, body: bytes, content_type: str, metadata: dict[str, str]
    ) -> None:
        size = self.config.multipart_part_bytes
        if len(body) > size * _MAX_PARTS:
            size = -(-len(body) // _MAX_PARTS)
        bucket = self.config.bucket
        with self._errors("CreateMultipartUpload", key):
            created = await self.client.create_multipart_upload(
                Bucket=bucket,
                Key=key,
                ContentType=content_type,
                Metadata=metadata,
                **self._checksum,
            )
        upload_id = created["UploadId"]
        view = memoryview(body)

        async def upload(number: int, start: int) -> dict[str, Any]:
            with self._errors("UploadPart", f"{key} part {number}"):
                response = await self.client.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(view[start : start + size]),
                    **self._checksum,
                )
            done = {"ETag": response["ETag"], "PartNumber": number}
            if "ChecksumCRC32" in response and self._checksum:
                done["ChecksumCRC32"] = response["ChecksumCRC32"]
            return done

        try:
            starts = range(0, len(body), size)
            uploaded = await self._bounded(lambda i: upload(i + 1, starts[i]), range(len(starts)))
            with self._errors("CompleteMultipartUpload", key):
                await self.client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": uploaded},
                )
        except BaseException:
            with contextlib.suppress(Exception):  # S3 lifecycle rules reap what this misses
                await asyncio.wait_for(
                    self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id),
                    10,
                )
            raise

    async def _bounded(self, call: Callable[[_T], Awaitable[_R]], items: Sequence[_T]) -> list[_R]:
        """``call(item)`` for every item, at most ``concurrency`` at once; raise the first error."""
        limit = asyncio.Semaphore(self.config.concurrency)

        async def one(item: _T) -> _R:
            async with limit:
                return await call(item)

        results = await asyncio.gather(*(one(i) for i in items), return_exceptions=True)
        done: list[_R] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            done.append(result)
        return done

    @contextlib.contextmanager
    def _errors(self, operation: str, key: str) -> Iterator[None]:
        """Turn any client, network or timeout failure into a SinkError naming the call."""
        try:
            yield
        except SinkError:
            raise
        except Exception as exc:
            raise self._sink_error(operation, key, exc) from exc

    def _sink_error(self, operation: str, key: str, exc: BaseException) -> SinkError:
        return SinkError(
            f"{operation} s3://{self.config.bucket}/{key} failed: {self._describe(exc)}",
            sink=self.name,
        )

    def _describe(self, exc: BaseException) -> str:
        """Class and message of a failure, with any configured secret blanked out."""
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            text = f"{error.get('Code', 'error')} (HTTP {status}): {error.get('Message', '')}"
        elif isinstance(exc, NoCredentialsError):
            text = (
                "no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, an IAM role, or access_key_id/secret_access_key)"
            )
        else:
            first = str(exc).splitlines()[0] if str(exc) else ""
            text = f"{type(exc).__name__}: {first}"
        for secret in (
            self.config.access_key_id,
            self.config.secret_access_key,
            self.config.session_token,
        ):
            if secret is not None and secret.get_secret_value():
                text = text.replace(secret.get_secret_value(), "**********")
        return text[:500]
