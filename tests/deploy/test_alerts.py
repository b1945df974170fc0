"""What operators get beside the chart: the PrometheusRule's alerts, checked and tested by
Prometheus' own promtool on fixture series, and the Grafana dashboard, whose every query
names a metric nopoll exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from receiver.metrics import Metrics
from tests.deploy.chart import Rendered, default_values, with_changes
from tests.deploy.podman import require

FIXTURES = Path(__file__).parent / "fixtures"


def _enabled(render: Any) -> Rendered:
    values = with_changes(
        default_values(),
        metrics__prometheusRule={"enabled": True},
        metrics__dashboard={"enabled": True},
    )
    rendered: Rendered = render(values)
    return rendered


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    require("promtool")
    promtool = shutil.which("promtool")
    assert promtool is not None
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def test_both_are_off_by_default(render: Any) -> None:
    rendered = render(default_values())
    assert rendered.of_kind("PrometheusRule") == []
    assert not [
        d for d in rendered.of_kind("ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]


def test_promtool_checks_the_rules_and_every_alert_fires_on_its_fixture(
    render: Any, tmp_path: Path
) -> None:
    [rule] = _enabled(render).of_kind("PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    checked = _promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    cases = yaml.safe_load((FIXTURES / "alerts_test.yaml").read_text())
    shutil.copy(FIXTURES / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    firing = {
        t["alertname"] for c in cases["tests"] for t in c["alert_rule_test"] if t["exp_alerts"]
    }
    quiet = {
        t["alertname"] for c in cases["tests"] for t in c["alert_rule_test"] if not t["exp_alerts"]
    }
    assert alerts == firing == quiet, "every alert is tested firing and not firing"
    tested = _promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _exported_names() -> set[str]:
    """Every series name nopoll's /metrics can show (counters with _total, histograms
    with _bucket/_sum/_count, the gauges read at scrape time)."""
    metrics = Metrics()
    metrics.set_queue_depths(
        {
            "nopoll_queue_ready_jobs": 0.0,
            "nopoll_queue_deferred_jobs": 0.0,
            "nopoll_batch_queue_jobs": 0.0,
            "nopoll_queue_oldest_ready_age_seconds": 0.0,
            "nopoll_worker_heartbeat": 1.0,
        }
    )
    metrics.set_watch_counts({"openai": {"expired": 1}})
    names = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
        if family.type == "histogram":
            names.add(f"{family.name}_bucket")
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_every_query_names_a_metric_nopoll_exports(render: Any) -> None:
    rendered = _enabled(render)
    [cm] = [
        d for d in rendered.of_kind("ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    dashboard = json.loads(cm["data"]["nopoll.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    [rule] = rendered.of_kind("PrometheusRule")
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    exported = _exported_names()
    used = {name for e in exprs for name in re.findall(r"\bnopoll_[a-z_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for figure in (
        "callback to row",
        "provider errors",
        "sink write time",
        "queue",
        "dead letters",
    ):
        assert figure in titles
