"""Hypothesis strategies for what a client or a provider can send nopoll: webhook requests
(path, headers, body; some correctly signed) and batch result lines in each dialect's
shape. Shared by the fuzz tests and ``bench/fuzz.py``."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import orjson
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook

EVENTS = [
    "response.completed",
    "response.failed",
    "response.incomplete",
    "response.cancelled",
    "batch.completed",
    "batch.expired",
    "batch.failed",
]

_text = st.text(max_size=40)
_weird_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=20),
    st.just("\x00"),
    st.just("a" * 70_000),
    st.just("../../etc/passwd"),
    st.just("resp_ok"),
    st.sampled_from(["http://127.0.0.1:1/x", "resp_\u202e", "%2e%2e", " resp", "resp/1"]),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    _weird_text,
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)


def _deep(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def _event(event_type: Any, data: Any, extra: dict[str, Any]) -> bytes:
    return orjson.dumps({"id": "evt_1", "type": event_type, "data": data, **extra})


bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(
        _event,
        st.one_of(st.sampled_from(EVENTS), _scalars),
        st.one_of(st.fixed_dictionaries({"id": _weird_text}), json_values),
        st.dictionaries(_text, json_values, max_size=3),
    ),
    st.integers(min_value=10, max_value=5000).map(_deep),
    st.just(b"\xff\xfe{}"),
    st.just(b'{"type":"response.completed","data":{"id":"resp_\xc3\x28"}}'),
    st.just(b"[]"),
    st.just(b"null"),
)

_header_names = st.sampled_from(
    ["webhook-id", "webhook-timestamp", "webhook-signature", "content-type", "x-junk"]
)
_header_values = st.one_of(
    st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"v1,", b"v1,AAAA", b"v2,abc", b"0", b"-1", b"99999999999999999999"]),
)


@st.composite
def webhook_requests(
    draw: st.DrawFn, secret: str
) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    """(path, headers, body): a third are signed with ``secret`` by the standardwebhooks
    package (so parsing past the signature is reached too), the rest carry junk headers."""
    path = draw(
        st.one_of(
            st.just(b"/webhooks/sim"),
            st.sampled_from(
                [b"/webhooks/", b"/webhooks/nope", b"/webhooks/t/abc.def", b"/webhooks/sim/x"]
            ),
            st.binary(min_size=1, max_size=30).map(
                lambda b: b"/webhooks/" + bytes(c for c in b if 0x21 <= c < 0x7F and c not in b"?#")
            ),
        )
    )
    body = draw(bodies)
    headers: list[tuple[bytes, bytes]] = []
    if draw(st.integers(0, 2)) == 0:
        msg_id = draw(st.sampled_from(["msg_1", "msg_" + "x" * 300, "m\u00e9", ""]))
        stamp = int(time.time()) + draw(st.sampled_from([0, 0, -1000, 1000]))
        try:
            text = body.decode()
        except UnicodeDecodeError:
            text = None
        if text is not None and msg_id:
            signature = Webhook(secret).sign(msg_id, datetime.fromtimestamp(stamp, tz=UTC), text)
            headers += [
                (b"webhook-id", msg_id.encode()),
                (b"webhook-timestamp", str(stamp).encode()),
                (b"webhook-signature", signature.encode()),
            ]
    headers += draw(st.lists(st.tuples(_header_names.map(str.encode), _header_values), max_size=5))
    return path, headers, body


def dialect_lines(dialect: str) -> st.SearchStrategy[bytes]:
    """A result line as ``dialect`` writes them, with any field wrong, or no JSON at all."""
    if dialect == "openai":
        good = st.fixed_dictionaries(
            {
                "id": _weird_text,
                "custom_id": st.one_of(_weird_text, _scalars),
                "response": st.one_of(
                    json_values,
                    st.fixed_dictionaries(
                        {"status_code": st.one_of(st.just(200), _scalars), "body": json_values}
                    ),
                ),
                "error": st.one_of(st.none(), json_values),
            }
        )
    else:  # sference
        good = st.fixed_dictionaries(
            {
                "custom_id": st.one_of(_weird_text, _scalars),
                "status": st.one_of(st.sampled_from(["completed", "failed", "expired"]), _scalars),
                "result_json": st.one_of(
                    json_values, json_values.map(lambda v: orjson.dumps(v).decode())
                ),
                "error_json": st.one_of(st.none(), json_values),
            }
        )
    return st.one_of(
        good.map(orjson.dumps),
        st.binary(max_size=200),
        st.integers(min_value=10, max_value=3000).map(_deep),
        good.map(lambda d: orjson.dumps(d)[: max(1, len(orjson.dumps(d)) // 2)]),  # truncated
        st.just(b"\x00"),
        st.just(b'{"custom_id": "\\u0000", "status": "completed", "result_json": {}}'),
    )
