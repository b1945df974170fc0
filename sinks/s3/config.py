"""The ``s3`` sink's config model (:class:`S3SinkConfig`), shared by the sink and its
S3 calls."""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from sinks.base import SinkConfig

__all__ = ["MIB", "S3SinkConfig"]

MIB = 1024 * 1024
_MIN_PART = 5 * MIB  # S3's smallest part (all but the last)
_MAX_PART = 5 * 1024 * MIB
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


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

    def location(self) -> str:
        """The bucket's name."""
        return self.bucket

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
