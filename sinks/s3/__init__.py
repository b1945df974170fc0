"""The ``s3`` sink: an object per batch part, keys shaped only by checked ids."""

from sinks.s3.config import S3SinkConfig
from sinks.s3.sink import MANIFEST_SCHEMA, S3Sink

__all__ = ["MANIFEST_SCHEMA", "S3Sink", "S3SinkConfig"]
