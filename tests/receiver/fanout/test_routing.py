"""Routes: which sinks a result goes to."""

from __future__ import annotations

import pytest

from nopoll.envelope import envelope_from_response
from nopoll.exceptions import ConfigError
from receiver.config.settings import RouteConfig, load_settings
from receiver.demo.simulator import make_response
from receiver.fanout.fanout import FanOut, ManagedSink
from receiver.fanout.routing import Router
from receiver.metrics import Metrics
from sinks.jsonl import JsonlSinkConfig


def env(provider="sim", status="completed", label="eval", model="sim-model-1"):
    body = make_response(
        "resp_1", status=status, metadata={"label": label, "stream_id": "s1"}, model=model
    )
    return envelope_from_response(body, provider=provider, received_at="2026-01-01T00:00:00.000Z")


def router(*routes: dict) -> Router:
    return Router([RouteConfig.model_validate(r) for r in routes], ["db", "lake", "bus"])


def test_no_routes_means_every_sink():
    assert router().sinks_for(env()) == ("db", "lake", "bus")


def test_match_on_fields_lists_and_metadata():
    r = router(
        {"match": {"provider": "sim", "kind": ["response", "batch_row"]}, "sinks": ["db"]},
        {"match": {"status": "failed"}, "sinks": ["bus"]},
        {"match": {"metadata.label": ["eval", "prod"], "model": "sim-model-1"}, "sinks": ["lake"]},
        {"match": {"metadata.stream_id": "other"}, "sinks": ["bus"]},
    )
    assert r.sinks_for(env()) == ("db", "lake")
    assert r.sinks_for(env(status="failed", label="x")) == ("db", "bus")
    assert r.sinks_for(env(provider="other", label="none")) == ()


def test_unrouted_results_are_counted(tmp_path):
    metrics = Metrics()
    r = router({"match": {"provider": "nobody"}, "sinks": ["db"]})
    config = JsonlSinkConfig(dir=tmp_path)
    sinks = {n: ManagedSink(n, config, metrics) for n in ("db", "lake", "bus")}
    shares = FanOut(sinks, r, metrics).route([env(), env()])
    assert shares == {}
    assert 'nopoll_unrouted_results_total{provider="sim"} 2.0' in metrics.render().decode()


def test_unknown_sink_in_a_route_fails_at_start_up(tmp_path):
    raw = {"data_dir": str(tmp_path), "routes": [{"match": {"provider": "x"}, "sinks": ["nope"]}]}
    with pytest.raises(ConfigError, match=r"routes\.0\.sinks: unknown sink 'nope'"):
        load_settings(None, env={}, overrides=raw)
