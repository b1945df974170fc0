"""docs/http.md lists every metric receiver/metrics.py defines, with its type and labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from receiver import metrics as metrics_module
from receiver.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"counter": "counter", "histogram": "histogram", "gauge": "gauge"}


def defined() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every exported name -> (type, labels), read from a live Metrics object and the source."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    m = Metrics()
    for value in vars(m).values():
        if isinstance(value, MetricWrapperBase):
            kind = value._type
            name = value._name + ("_total" if kind == "counter" else "")
            found[name] = (kind, tuple(value._labelnames))
    source = Path(metrics_module.__file__).read_text()
    for name in re.findall(r'"(nopoll_[a-z_]+)"', source):
        if name not in found and f"{name}_total" not in found:
            found[name] = ("gauge", ())  # the queue depths, collected at scrape time
    return found


def test_every_metric_is_documented_with_type_and_labels() -> None:
    doc = (ROOT / "docs" / "http.md").read_text()
    rows = {
        m.group(1): line
        for line in doc.splitlines()
        if (m := re.match(r"^\|\s*`(nopoll_[a-z_]+)`\s*\|", line))
    }
    metrics = defined()
    assert len(metrics) >= 14
    missing = sorted(set(metrics) - set(rows))
    assert not missing, f"docs/http.md does not list: {', '.join(missing)}"
    for name, (kind, labels) in metrics.items():
        row = rows[name]
        assert kind in row, f"{name}: type {kind} not in its row"
        for label in labels:
            assert f"`{label}`" in row, f"{name}: label {label} not in its row"
    stale = sorted(set(rows) - set(metrics))
    assert not stale, f"docs/http.md lists metrics that do not exist: {', '.join(stale)}"
