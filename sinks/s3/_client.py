"""The S3 calls of the ``s3`` sink: one aiobotocore client, bounded concurrency, and every
failure as a :class:`~nopoll.exceptions.SinkError` that names the call and the object and
never a credential."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import ClientError, NoCredentialsError

from nopoll.exceptions import SinkError
from nopoll.wire import url_secrets
from sinks.s3.config import S3SinkConfig

__all__ = ["S3Calls"]

log = logging.getLogger("nopoll.sinks.s3")

_MAX_PARTS = 10_000
_T = TypeVar("_T")
_R = TypeVar("_R")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Calls:
    """The S3 client of one s3 sink (``sink`` names it in errors)."""

    def __init__(self, sink: str, config: S3SinkConfig) -> None:
        self.sink = sink
        self.config = config
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._checksum: dict[str, str] = {}

    async def open(self) -> None:
        """Create the client and check (or create) the bucket."""
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
            with self.errors("create client", ""):
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
            if _code(exc) in ("403", "AccessDenied", "Forbidden"):
                # A write-only policy (no s3:ListBucket) cannot check; the writes will tell.
                log.warning("cannot check bucket %s (access denied); going on", bucket)
                return
            if _code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                raise self.sink_error("HeadBucket", "", exc) from exc
        except Exception as exc:
            raise self.sink_error("HeadBucket", "", exc) from exc
        if not self.config.create_bucket:
            raise SinkError(
                f"bucket {bucket!r} does not exist (create it, or set create_bucket: true)",
                sink=self.sink,
            )
        region = self.config.region or self._client.meta.region_name
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if region and region not in ("us-east-1", "aws-global"):
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            await self._client.create_bucket(**kwargs)
            log.info("created bucket %s", bucket)
        except ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self.sink_error("CreateBucket", "", exc) from exc
        except Exception as exc:
            raise self.sink_error("CreateBucket", "", exc) from exc

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def client(self) -> Any:
        """The open aiobotocore S3 client."""
        if self._client is None:
            raise SinkError("not open", sink=self.sink)
        return self._client

    async def put(
        self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None
    ) -> str:
        """One object in one PutObject; returns its ETag."""
        with self.errors("PutObject", key):
            response = await self.client.put_object(
                Bucket=self.config.bucket,
                Key=key,
                Body=body,
                ContentType=content_type,
                Metadata=metadata or {},
            )
        return str(response.get("ETag", ""))

    async def put_multipart(
        self, key: str, body: bytes, content_type: str, metadata: dict[str, str]
    ) -> str:
        """One object as a multipart upload of ``multipart_part_bytes`` pieces (more when
        there would be over 10,000), ``concurrency`` at a time; aborted when it fails.
        Returns the object's ETag."""
        size = self.config.multipart_part_bytes
        if len(body) > size * _MAX_PARTS:
            size = -(-len(body) // _MAX_PARTS)
        bucket = self.config.bucket
        with self.errors("CreateMultipartUpload", key):
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
            with self.errors("UploadPart", f"{key} part {number}"):
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
            uploaded = await self.bounded(lambda i: upload(i + 1, starts[i]), range(len(starts)))
            with self.errors("CompleteMultipartUpload", key):
                completed = await self.client.complete_multipart_upload(
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
        return str(completed.get("ETag", ""))

    async def bounded(self, call: Callable[[_T], Awaitable[_R]], items: Sequence[_T]) -> list[_R]:
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
    def errors(self, operation: str, key: str) -> Iterator[None]:
        """Turn any client, network or timeout failure into a SinkError naming the call."""
        try:
            yield
        except SinkError:
            raise
        except Exception as exc:
            raise self.sink_error(operation, key, exc) from exc

    def sink_error(self, operation: str, key: str, exc: BaseException) -> SinkError:
        return SinkError(
            f"{operation} s3://{self.config.bucket}/{key} failed: {self._describe(exc)}",
            sink=self.sink,
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
        for part in url_secrets(self.config.endpoint_url or ""):  # botocore quotes its URLs
            text = text.replace(part, "***")
        return text[:500]
