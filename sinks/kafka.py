"""The ``kafka`` sink: one message per envelope, keyed ``{provider}:{key}``.

:class:`KafkaSink` sends the envelope as JSON with the headers ``nopoll-kind``,
``nopoll-status``, ``nopoll-event-id`` (and ``traceparent`` while tracing). A write
waits for every acknowledgement and fails whole, so delivery is at least once. A message
over ``max_message_bytes`` carries ``body_ref`` from the claim-check hook instead of
``body``; one that still cannot fit is refused alone
(:class:`~nopoll.exceptions.SinkRowsRejected`).

See docs/sinks/kafka.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import Field, SecretStr, field_validator, model_validator

from nopoll.envelope import DEFAULT_TENANT, Envelope
from nopoll.exceptions import SinkError, SinkRejected, SinkRowsRejected
from nopoll.wire import url_origin
from sinks._trace import trace_headers
from sinks.base import ClaimCheck, SinkBase, SinkConfig

__all__ = ["ClaimCheck", "KafkaSink", "KafkaSinkConfig"]

log = logging.getLogger("nopoll.sinks.kafka")

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SASL = ("SASL_PLAINTEXT", "SASL_SSL")
_TLS = ("SSL", "SASL_SSL")
_Headers = list[tuple[str, bytes]]


class KafkaSinkConfig(SinkConfig):
    """``{type: kafka, bootstrap_servers: "kafka:9092", topic: llm.results}``."""

    type: Literal["kafka"] = "kafka"
    bootstrap_servers: str
    """Comma-separated ``host:port`` list of brokers to bootstrap from."""
    topic: str
    acks: Literal["all", 1, 0] = "all"
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    linger_ms: int = Field(default=5, ge=0)
    max_batch_size: int = Field(default=1048576, gt=0)
    """Bytes the producer gathers per partition before a send (aiokafka's batch size)."""
    max_message_bytes: int = Field(default=1048576, gt=0)
    """The broker's limit on one message (Kafka's default is 1 MiB); larger envelopes go
    out with ``body_ref`` instead of ``body`` when ``claim_check`` names an s3 sink."""
    claim_check: str | None = None
    """The name of an ``s3`` sink that keeps the bodies of envelopes too large for a
    message (claim-check); None: such a write fails and becomes a dead letter."""
    enable_idempotence: bool = True
    """Some Kafka-compatible brokers (tansu) lack idempotent producers: turn it off there."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    """CA bundle for a broker whose certificate is not signed by a public CA."""

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",")]
        if not all(servers) or any(" " in s for s in servers):
            raise ValueError("must be a comma-separated list of host:port")
        return ",".join(servers)

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str) -> str:
        if not _TOPIC.match(value) or value in (".", ".."):
            raise ValueError("must be a Kafka topic name: 1-249 characters of A-Z a-z 0-9 . _ -")
        return value

    @field_validator("acks", mode="before")
    @classmethod
    def _acks(cls, value: object) -> object:
        # `${KAFKA_ACKS}` arrives as a string; -1 is Kafka's spelling of "all"
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        return "all" if value == -1 else value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.enable_idempotence and self.acks != "all":
            raise ValueError(
                "acks must be 'all' while enable_idempotence is true "
                "(set enable_idempotence: false to use acks 0 or 1)"
            )
        if self.max_batch_size > self.max_message_bytes:
            raise ValueError(
                "max_batch_size must not exceed max_message_bytes "
                "(the broker rejects a batch larger than its message limit)"
            )
        sasl = self.security_protocol in _SASL
        if sasl and (self.sasl_plain_username is None or self.sasl_plain_password is None):
            raise ValueError(
                "sasl_plain_username and sasl_plain_password are required "
                f"with security_protocol {self.security_protocol}"
            )
        if not sasl and (self.sasl_plain_username or self.sasl_plain_password):
            raise ValueError(
                "sasl_plain_username and sasl_plain_password need "
                "security_protocol SASL_PLAINTEXT or SASL_SSL"
            )
        if self.ssl_cafile is not None and self.security_protocol not in _TLS:
            raise ValueError("ssl_cafile needs security_protocol SSL or SASL_SSL")
        return self

    def location(self) -> str:
        """The bootstrap servers; a list written as a URL shows only its origin."""
        servers = self.bootstrap_servers
        return url_origin(servers) if "://" in servers else servers

    def rebased(self, base: Path) -> Self:
        if self.ssl_cafile is None or self.ssl_cafile.is_absolute():
            return self
        return self.model_copy(update={"ssl_cafile": base / self.ssl_cafile})


class KafkaSink(SinkBase):
    """Produces one message per envelope to a Kafka topic (at-least-once)."""

    config_model = KafkaSinkConfig
    config: KafkaSinkConfig

    def __init__(
        self, name: str, config: KafkaSinkConfig, *, claim_check: ClaimCheck | None = None
    ) -> None:
        super().__init__(name, config)
        self.claim_check = claim_check
        """Called for an envelope over ``max_message_bytes``; None fails such a write."""
        self._producer: Any = None

    def __repr__(self) -> str:
        return f"KafkaSink(name={self.name!r}, topic={self.config.topic!r})"

    def _producer_options(self) -> dict[str, Any]:
        c = self.config
        options: dict[str, Any] = {
            "bootstrap_servers": c.bootstrap_servers,
            "client_id": f"nopoll-{self.name}",
            "acks": c.acks,
            "compression_type": c.compression_type,
            "linger_ms": c.linger_ms,
            "max_batch_size": c.max_batch_size,
            "max_request_size": c.max_message_bytes,
            "enable_idempotence": c.enable_idempotence,
            "request_timeout_ms": max(1, int(c.timeout_s * 1000)),
            "security_protocol": c.security_protocol,
        }
        if c.security_protocol in _TLS:
            options["ssl_context"] = ssl.create_default_context(
                cafile=str(c.ssl_cafile) if c.ssl_cafile else None
            )
        if c.security_protocol in _SASL and c.sasl_plain_password is not None:
            options["sasl_mechanism"] = c.sasl_mechanism
            options["sasl_plain_username"] = c.sasl_plain_username
            options["sasl_plain_password"] = c.sasl_plain_password.get_secret_value()
        return options

    async def open(self) -> None:
        if self._producer is not None:
            return
        producer: Any = None
        try:
            producer = AIOKafkaProducer(**self._producer_options())
            async with asyncio.timeout(self.config.timeout_s):
                await producer.start()
        except Exception as exc:
            if producer is not None:
                with contextlib.suppress(Exception):
                    await producer.stop()
            reason = "timed out" if isinstance(exc, TimeoutError) else _describe(exc)
            if self.config.enable_idempotence and not isinstance(
                exc, TimeoutError | KafkaConnectionError
            ):
                reason += " (a broker without idempotent producers needs enable_idempotence: false)"
            raise SinkError(
                f"cannot start producing to {self.config.bootstrap_servers}: {reason}",
                sink=self.name,
            ) from exc
        self._producer = producer

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        producer = self._producer
        if producer is None:
            raise SinkError("not open", sink=self.name)
        # Everything is serialized (and claim-checked) before the first send, so a
        # message that cannot go out yet fails the write before any of it is sent; one
        # that can never go out (too large) is refused alone, after the others are sent.
        records = []
        refused: dict[str, str] = {}
        traced = [(k, v.encode()) for k, v in trace_headers().items()]  # W3C traceparent
        for env in envelopes:
            try:
                records.append(await self._record(env, traced))
            except SinkRejected as exc:
                refused[env.key] = str(exc.args[0])
        topic = self.config.topic
        futures: list[asyncio.Future[Any]] = []
        sent = False
        try:
            for key, value, headers in records:
                futures.append(await producer.send(topic, value=value, key=key, headers=headers))
            sent = True
        except Exception as exc:
            raise SinkError(
                f"send to {topic} failed after {len(futures)} of {len(records)} messages: "
                f"{_describe(exc)}",
                sink=self.name,
            ) from exc
        finally:
            if not sent:  # nobody will await these: do not leave their errors unretrieved
                for future in futures:
                    if future.done() and not future.cancelled():
                        future.exception()
                    future.cancel()
        results = await asyncio.gather(*futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SinkError(
                f"{len(errors)} of {len(records)} messages to {topic} not acknowledged: "
                f"{_describe(errors[0])}",
                sink=self.name,
            ) from errors[0]
        if refused:
            raise SinkRowsRejected(
                f"{len(refused)} of {len(envelopes)} messages refused: "
                + "; ".join(sorted(set(refused.values())))[:1500],
                sink=self.name,
                rejected=refused,
            )

    async def _record(
        self, env: Envelope, traced: _Headers | None = None
    ) -> tuple[bytes, bytes, _Headers]:
        """Key, value and headers of one envelope's message (``traced``: the trace context's
        headers to add), claim-checked if too large."""
        name = f"{env.provider}:{env.key}"
        if env.tenant != DEFAULT_TENANT:  # a provider name has no "/": no default key is like it
            name = f"{env.tenant}/{name}"
        limit = self.config.max_message_bytes
        try:
            key = name.encode()
            headers: _Headers = [
                ("nopoll-kind", env.kind.encode()),
                ("nopoll-status", env.status.encode()),
                ("nopoll-event-id", (env.event_id or "").encode()),
                *(traced or ()),
            ]
            value = env.to_json()
        except (TypeError, UnicodeEncodeError) as exc:
            raise SinkError(f"cannot serialize {name}: {_describe(exc)}", sink=self.name) from exc
        size = _size(key, value, headers)
        if size <= limit:
            return key, value, headers
        if self.claim_check is None:
            raise SinkRejected(
                f"message {name} is {size} bytes, over max_message_bytes ({limit}); "
                "set claim_check to an s3 sink (claim-check: body_ref in place of body)",
                sink=self.name,
            )
        try:
            ref = await self.claim_check(env)
        except SinkError:
            raise
        except Exception as exc:
            raise SinkError(
                f"claim-check of {name} failed: {_describe(exc)}", sink=self.name
            ) from exc
        doc = env.to_dict()
        del doc["body"]
        doc["body_ref"] = ref
        value = orjson.dumps(doc)
        checked = _size(key, value, headers)
        if checked > limit:
            raise SinkRejected(
                f"message {name} is {checked} bytes even without its body, "
                f"over max_message_bytes ({limit})",
                sink=self.name,
            )
        log.info("sink %s: %s is %d bytes; sent with body_ref %s", self.name, name, size, ref)
        return key, value, headers

    async def aclose(self) -> None:
        if self._producer is None:
            return
        producer, self._producer = self._producer, None
        try:
            await producer.stop()  # flushes what is pending, bounded by request_timeout_ms
        except Exception as exc:
            log.warning("sink %s: closing the producer failed: %s", self.name, _describe(exc))


def _size(key: bytes, value: bytes, headers: _Headers) -> int:
    """The record's size as the broker limits it: one batch holding only this record."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers))


def _describe(exc: BaseException) -> str:
    """An error's class and first line (Kafka errors carry no credentials)."""
    name = type(exc).__name__
    text = str(exc).splitlines()[0] if str(exc) else ""
    if not text.startswith(name):  # aiokafka's errors name themselves already
        text = f"{name}: {text}" if text else name
    return text[:300]
