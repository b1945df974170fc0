"""The Helm chart as the deploy tests read it: its paths and ci/ scenarios, one rendering
(:class:`Rendered`), and what Kubernetes would make of a rendered workload."""

from __future__ import annotations

import base64
import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "nopoll"
SCENARIOS = {
    "default": CHART / "ci" / "default-values.yaml",
    "all-options": CHART / "ci" / "all-options-values.yaml",
}
RELEASE = "rel"
NAMESPACE = "nopoll"
CONFIG_PATH = "/etc/nopoll/nopoll.yaml"
POD_KINDS = ("Deployment", "StatefulSet", "Pod")


@dataclass
class Rendered:
    """One `helm template`: manifests by template path, parsed documents, the notes."""

    values: dict[str, Any]
    manifests: dict[str, str]
    docs: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for path, text in sorted(self.manifests.items()):
            if path.endswith("NOTES.txt"):
                continue
            self.docs.extend(d for d in yaml.safe_load_all(text) if d)

    @property
    def notes(self) -> str:
        return next((t for p, t in self.manifests.items() if p.endswith("NOTES.txt")), "")

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def component(self, kind: str, component: str) -> dict[str, Any]:
        found = [
            d
            for d in self.of_kind(kind)
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {kind} of component {component}, got {found}"
        return found[0]

    def config_map(self) -> dict[str, str]:
        """The data of the ConfigMap the pods mount at /etc/nopoll."""
        [cm] = [
            d
            for d in self.of_kind("ConfigMap")
            if "helm.sh/hook" not in d["metadata"].get("annotations", {})
            and "nopoll.yaml" in d["data"]
        ]
        return dict(cm["data"])

    def secrets(self) -> dict[str, dict[str, str]]:
        """Every rendered Secret's data, base64-decoded."""
        return {
            s["metadata"]["name"]: {
                k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()
            }
            for s in self.of_kind("Secret")
        }


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment, StatefulSet or Pod."""
    spec: dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Init and main containers of a workload."""
    spec = pod_spec(doc)
    return [*spec.get("initContainers", []), *spec["containers"]]


def container_env(container: dict[str, Any], rendered: Rendered) -> dict[str, str]:
    """The environment Kubernetes would give the container, resolved from rendered Secrets.

    envFrom Secrets first, then ``env`` in order with ``$(VAR)`` expansion, as the kubelet
    does. Sources outside the release (a ConfigMap the user provides) add nothing; a
    reference to a key of a rendered Secret that does not exist raises KeyError.
    """
    secrets = rendered.secrets()
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("secretRef")
        if ref and ref["name"] in secrets:
            env.update(secrets[ref["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                str(var["value"]),
            )
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            if ref["name"] in secrets:
                env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def load_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(path.read_text())
    return values


# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas
# kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", "latest")
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


def default_values() -> dict[str, Any]:
    return load_values(SCENARIOS["default"])


def worker_health_port(values: dict[str, Any]) -> int:
    """worker.healthPort as the chart resolves it (values.yaml's default: 8001)."""
    port: int = values.get("worker", {}).get("healthPort", 8001)
    return port


def with_changes(base: dict[str, Any], **paths: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with nested keys set (``config__log_level`` is config.log_level)."""
    values = copy.deepcopy(base)
    for dotted, value in paths.items():
        node = values
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return values


def render_error(render: Any, values: dict[str, Any]) -> str:
    """The message of Helm's refusal to render ``values``."""
    import helm_python

    with pytest.raises((helm_python.HelmRenderError, helm_python.HelmValuesError)) as excinfo:
        render(values)
    return str(excinfo.value)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector matches ``labels``: a Service's plain map, or a
    ``matchLabels`` / ``matchExpressions`` pair (In, NotIn, Exists, DoesNotExist)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True
