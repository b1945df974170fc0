"""Every dialect row resolves to a class that reads its provider's shapes, and a simulator
profile; the OpenAI-style callback reading."""

from __future__ import annotations

import pytest

from nopoll.kinds import KINDS
from receiver.demo.profiles import PROFILES, SimProfile
from receiver.providers import DIALECTS, dialect_type
from receiver.providers.base import BadCallback, standard_callback

SHAPES = ("parse_callback", "object_status", "normalize", "batch_pending", "batch_facts")


@pytest.mark.parametrize("name", list(DIALECTS))
def test_every_row_names_a_dialect_that_reads_its_shapes_and_a_profile(name):
    cls = dialect_type(name)
    assert all(callable(getattr(cls, method, None)) for method in SHAPES)
    assert isinstance(PROFILES[name], SimProfile)
    info = DIALECTS[name]
    assert info.retry_statuses and all(500 <= s < 600 for s in info.retry_statuses)
    assert info.sample_line.startswith("{")


def test_a_standard_callback_names_its_kind_and_object():
    cb = standard_callback({"type": "response.completed", "data": {"id": "resp_1"}})
    assert cb is not None and (cb.event_type, cb.kind, cb.object_id) == (
        "response.completed",
        KINDS["response"],
        "resp_1",
    )
    assert standard_callback({"type": "batch.expired", "data": {"id": "b"}}).kind is KINDS["batch"]
    assert standard_callback({"type": "file.created", "data": {"id": "f"}}) is None
    with pytest.raises(BadCallback, match="string 'type'"):
        standard_callback({"type": 3})
    with pytest.raises(BadCallback, match=r"data\.id"):
        standard_callback({"type": "batch.completed", "data": {"id": "a/b"}})


def test_a_message_batch_keeps_its_status_in_processing_status():
    cls = dialect_type("anthropic")
    dialect = cls.__new__(cls)  # no client needed to read an object
    assert dialect.object_status({"processing_status": "ended"}) == "ended"
    assert dialect.batch_pending({"processing_status": "in_progress"}) == "in_progress"
    assert dialect.batch_pending({"processing_status": "ended"}) is None
    with pytest.raises(BadCallback):
        cls.parse_callback({"type": "batch.completed", "data": {"id": "msgbatch_1"}})
