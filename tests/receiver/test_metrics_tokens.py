"""``nopoll_tokens_total``: the usage of landed results, summed per call (a batch chunk is
one increment per model and direction, not one per row)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from nopoll.envelope import BatchRow, envelope_from_response, envelope_from_row
from receiver.demo.simulator import make_response
from receiver.fanout.fanout import FanOut
from receiver.fanout.routing import Router
from receiver.metrics import Metrics

RECEIVED = "2026-11-29T10:00:00.123Z"


def _tokens(metrics: Metrics) -> dict[tuple[str, ...], float]:
    labels = ("provider", "model", "tenant", "kind", "direction")
    return {
        tuple(s.labels[k] for k in labels): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == "nopoll_tokens_total"
    }


def test_a_chunk_of_rows_is_summed_by_model_and_direction() -> None:
    rows = []
    for i in range(300):
        status = "completed" if i % 3 else "failed"  # a failed row has no usage
        body = make_response(f"r{i}", model=f"m{i % 2}") if status == "completed" else None
        row = BatchRow(index=i, custom_id=f"c{i}", status=status, body=body)
        rows.append(
            envelope_from_row(
                row,
                provider="sim",
                batch_id="b1",
                received_at=RECEIVED,
                event_id=None,
                tenant="acme",
            )
        )
    response = envelope_from_response(
        make_response("resp_1", model="m0"), provider="sim", received_at=RECEIVED
    )
    metrics = Metrics()
    fanout = FanOut({}, Router([], []), metrics)
    fanout.route(rows)  # one chunk
    fanout.route([response])  # one result
    assert _tokens(metrics) == {
        ("sim", "m0", "acme", "batch_row", "input"): 100 * 21.0,
        ("sim", "m0", "acme", "batch_row", "output"): 100 * 7.0,
        ("sim", "m1", "acme", "batch_row", "input"): 100 * 21.0,
        ("sim", "m1", "acme", "batch_row", "output"): 100 * 7.0,
        ("sim", "m0", "default", "response", "input"): 21.0,
        ("sim", "m0", "default", "response", "output"): 7.0,
    }


def test_results_without_usage_count_nothing() -> None:
    metrics = Metrics()
    body = {**make_response("resp_2"), "usage": None}
    metrics.count_tokens([envelope_from_response(body, provider="sim", received_at=RECEIVED)])
    assert _tokens(metrics) == {}


def test_provider_chosen_model_names_are_capped_and_folded_into_other() -> None:
    """A provider answering with a new model name for every result grows neither the
    series nor the activity fields past MAX_MODELS: later names count as ``other``, and no
    token is lost."""
    from receiver.metrics import MAX_MODELS

    metrics = Metrics()
    fanout = FanOut({}, Router([], []), metrics)
    for i in range(3 * MAX_MODELS):
        body = make_response(f"r{i}", model=f"model-{i}")
        fanout.route([envelope_from_response(body, provider="sim", received_at=RECEIVED)])
    tokens = _tokens(metrics)
    models = {model for _, model, *_ in tokens}
    assert len(models) == MAX_MODELS + 1 and "other" in models
    assert tokens[("sim", "other", "default", "response", "input")] == 2 * MAX_MODELS * 21.0
    assert sum(v for k, v in tokens.items() if k[-1] == "input") == 3 * MAX_MODELS * 21.0
