"""The Helm chart, rendered by Helm's own engine: lint, schemas, and what deployments rely on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from receiver.app import create_app
from receiver.cli import _parser, main
from receiver.config import (
    BatchConfig,
    HttpConfig,
    ProviderConfig,
    RetryConfig,
    RouteConfig,
    RouteMatch,
    Settings,
    WorkerConfig,
    load_settings,
)
from receiver.metrics import Metrics
from receiver.runtime import worker_health_app
from tests.deploy.conftest import (
    CHART,
    CONFIG_PATH,
    POD_KINDS,
    SCENARIOS,
    Rendered,
    container_env,
    containers,
    load_values,
    pod_spec,
)

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas
# kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", "latest")
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
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


# --- helm lint and the values schema ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_helm_lint_is_clean(helm: Any, name: str) -> None:
    report = helm.lint(str(CHART), load_values(SCENARIOS[name]), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_helm_lint_passes_without_values(helm: Any) -> None:
    # `helm lint helm/nopoll` as chart CI runs it: required values do not stop the lint.
    report = helm.lint(str(CHART))
    assert report["errors"] == [], report


def test_values_schema_is_valid_draft7_with_closed_objects() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    # Every object the chart defines is closed and every property says what it is for.
    open_on_purpose = {
        "global",
        "config.sinks.*",  # each sink type has its own keys; `nopoll config check` validates
        "config.routes.*.match",  # closed too, through patternProperties
    }

    def walk(node: dict[str, Any], path: str) -> None:
        props = node.get("properties")
        if props is not None and path not in open_on_purpose:
            assert node.get("additionalProperties") is False, f"{path or '<root>'} is not closed"
        for key, child in (props or {}).items():
            assert "description" in child, f"{path}.{key}: no description"
            walk(child, f"{path}.{key}" if path else key)
        for nested in (node.get("additionalProperties"), node.get("items")):
            if isinstance(nested, dict):
                walk(nested, f"{path}.*")

    walk(schema, "")


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicaCount": 3}, "additional properties 'replicaCount'"),
        ({"api": {"replica": 3}}, "additional properties 'replica'"),
        ({"config": {"redis_url": "redis://x"}}, "additional properties 'redis_url'"),
        ({"config": {"worker": {"max_job": 3}}}, "additional properties 'max_job'"),
        (
            {"config": {"providers": {"p": {"dialect": "openai", "base_url": "https://x"}}}},
            "webhook_secrets",
        ),
        (
            {
                "config": {
                    "providers": {
                        "p": {
                            "dialect": "openai",
                            "base_url": "https://x",
                            "api_key": "sk-live-123",
                            "webhook_secrets": ["${P_SECRET}"],
                        }
                    }
                }
            },
            "api_key",
        ),
        (
            {
                "config": {
                    "providers": {
                        "p": {
                            "dialect": "openai",
                            "base_url": "https://x",
                            "webhook_secrets": ["whsec_c2VjcmV0"],
                        }
                    }
                }
            },
            "webhook_secrets",
        ),
        ({"secret": {"env": {"not-a-var": "x"}}}, "not-a-var"),
        ({"worker": {"autoscaling": {"type": "vpa"}}}, "'hpa', 'keda'"),
        ({"worker": {"healthPort": 80}}, "healthPort"),
        ({"worker": {"healthPort": "8001"}}, "healthPort"),
    ],
)
def test_schema_rejects_mistakes(helm: Any, values: dict[str, Any], complaint: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as excinfo:
        chart.validate_schema(values)
    assert complaint in str(excinfo.value)


def test_schema_config_keys_match_nopoll_settings() -> None:
    """Every key of nopoll's config models is in the chart's schema, and nothing else."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]

    def keys(node: dict[str, Any]) -> set[str]:
        return set(node["properties"])

    expected = set(Settings.model_fields) - {"redis_url", "data_dir"}  # the chart sets these
    assert keys(config) == expected
    assert keys(config["properties"]["providers"]["additionalProperties"]) == set(
        ProviderConfig.model_fields
    )
    assert keys(config["properties"]["fetch_retry"]) == set(RetryConfig.model_fields)
    assert keys(config["properties"]["sink_retry"]) == set(RetryConfig.model_fields)
    assert keys(config["properties"]["http"]) == set(HttpConfig.model_fields)
    assert keys(config["properties"]["worker"]) == set(WorkerConfig.model_fields)
    assert keys(config["properties"]["batch"]) == set(BatchConfig.model_fields)
    route = config["properties"]["routes"]["items"]
    assert keys(route) == set(RouteConfig.model_fields)
    assert keys(route["properties"]["match"]) == set(RouteMatch.model_fields)


# --- every manifest is valid Kubernetes --------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(
    scenario: Rendered, kubernetes_validate: Any, kube_version: str
) -> None:
    version = kubernetes_validate.latest_version() if kube_version == "latest" else kube_version
    checked = 0
    for doc in scenario.docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}"
            ) from None
        checked += 1
    assert checked >= 8


_PREFIX_WEBHOOKS = [{"path": "/webhooks", "pathType": "Prefix"}]
VARIANTS = {
    "bundled-redis-without-auth-or-volume": {
        "redis": {
            "bundled": {
                "enabled": True,
                "auth": {"enabled": False},
                "persistence": {"enabled": False},
            }
        },
        "networkPolicy": {"enabled": True},
    },
    "bundled-redis-with-existing-secret": {
        "secret": None,
        "existingSecret": "nopoll-secrets",
        "redis": {"bundled": {"enabled": True}},
    },
    "minimal-objects": {
        "serviceAccount": {"create": False},
        "configCheck": {"enabled": False},
        "tests": {"enabled": False},
        "api": {"podDisruptionBudget": {"enabled": False}, "preStopSleepSeconds": 0},
        "worker": {
            "podDisruptionBudget": {"enabled": False},
            "livenessProbe": {"enabled": False},
            "autoscaling": {"enabled": True, "type": "hpa"},
        },
        "ingress": {"enabled": True, "hosts": [{"host": "h.example", "paths": _PREFIX_WEBHOOKS}]},
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_value_combinations_render_valid_manifests(
    render: Any, kubernetes_validate: Any, variant: str
) -> None:
    values = copy.deepcopy(default_values())
    for key, value in VARIANTS[variant].items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    if "redis" in VARIANTS[variant]:
        values["redis"].pop("url", None)
    rendered = render(values)
    for doc in rendered.docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(doc, "1.25.0", strict=True)
    for doc in rendered.of_kind("Deployment"):
        env = container_env(pod_spec(doc)["containers"][0], rendered)
        if "existingSecret" not in values:
            assert env["REDIS_URL"].startswith("redis://"), variant
            assert "$(" not in env["REDIS_URL"]


def test_custom_resources_use_known_fields(scenario: Rendered) -> None:
    """ServiceMonitor, PodMonitor and ScaledObject have no schema in kubernetes-validate:
    check by hand."""
    endpoint_fields = {"port", "path", "interval", "scrapeTimeout", "scheme"}
    for mon in scenario.of_kind("ServiceMonitor"):
        assert set(mon["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        assert mon["spec"]["endpoints"]
        for endpoint in mon["spec"]["endpoints"]:
            assert set(endpoint) <= endpoint_fields
    for mon in scenario.of_kind("PodMonitor"):
        assert set(mon["spec"]) <= {
            "selector",
            "podMetricsEndpoints",
            "namespaceSelector",
            "jobLabel",
            "podTargetLabels",
        }
        assert mon["spec"]["podMetricsEndpoints"]
        for endpoint in mon["spec"]["podMetricsEndpoints"]:
            # port is a container port name here (a string), as in ServiceMonitor.
            assert set(endpoint) <= endpoint_fields and isinstance(endpoint["port"], str)
    for so in scenario.of_kind("ScaledObject"):
        assert set(so["spec"]) <= {
            "scaleTargetRef",
            "minReplicaCount",
            "maxReplicaCount",
            "pollingInterval",
            "cooldownPeriod",
            "idleReplicaCount",
            "triggers",
            "advanced",
            "fallback",
        }
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] in {"metrics-api", "prometheus"}
            # KEDA's trigger metadata is map[string]string: a bare number is rejected.
            assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger


@pytest.mark.parametrize(
    ("keda", "trigger"),
    [
        ({"trigger": "metrics-api"}, "metrics-api"),
        (
            {"trigger": "prometheus", "prometheus": {"serverAddress": "http://prom:9090"}},
            "prometheus",
        ),
        (
            {
                "trigger": "prometheus",
                "prometheus": {
                    "serverAddress": "http://prom:9090",
                    "query": 'redis_key_size{key="nopoll:jobs"}',
                },
            },
            "prometheus",
        ),
    ],
)
def test_keda_scales_workers_on_the_queue(render: Any, keda: dict[str, Any], trigger: str) -> None:
    values = with_changes(
        default_values(), worker__autoscaling={"enabled": True, "type": "keda", "keda": keda}
    )
    rendered = render(values)
    assert rendered.of_kind("HorizontalPodAutoscaler") == []
    [scaled] = rendered.of_kind("ScaledObject")
    [spec] = scaled["spec"]["triggers"]
    assert spec["type"] == trigger
    meta = spec["metadata"]
    assert all(isinstance(v, str) for v in meta.values())
    service = rendered.component("Service", "api")
    if trigger == "metrics-api":
        port = service["spec"]["ports"][0]["port"]
        assert meta["url"] == f"http://{service['metadata']['name']}.nopoll.svc:{port}/metrics"
        assert (meta["format"], meta["valueLocation"]) == ("prometheus", "nopoll_queue_ready_jobs")
    elif "query" in keda["prometheus"]:
        assert meta["query"] == keda["prometheus"]["query"]
    else:
        assert meta["query"] == (
            'max(nopoll_queue_ready_jobs{namespace="nopoll",service="rel-nopoll-api"})'
        )
    assert "replicas" not in rendered.component("Deployment", "worker")["spec"]


def test_all_options_renders_every_template(render: Any) -> None:
    rendered = render(load_values(SCENARIOS["all-options"]))
    kinds = {d["kind"] for d in rendered.docs}
    assert kinds >= {
        "ConfigMap",
        "Secret",
        "ServiceAccount",
        "Service",
        "Deployment",
        "StatefulSet",
        "Ingress",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "ServiceMonitor",
        "PodMonitor",
        "NetworkPolicy",
        "Pod",
    }


# --- what the pods run -------------------------------------------------------------------


def test_api_probes_hit_routes_the_app_serves(scenario: Rendered, tmp_path: Path) -> None:
    settings = load_settings(None, env={}, overrides={"data_dir": str(tmp_path)})
    app = create_app(settings, redis=Redis.from_url("redis://127.0.0.1:9/0"), metrics=Metrics())
    get_routes = {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}

    [api] = pod_spec(scenario.component("Deployment", "api"))["containers"]
    assert api["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {"/healthz", "/readyz", "/metrics"} <= get_routes
    if scenario.of_kind("ServiceMonitor"):
        [endpoint] = scenario.of_kind("ServiceMonitor")[0]["spec"]["endpoints"]
        assert endpoint["path"] in get_routes


def test_worker_probe_and_scrape_hit_routes_of_its_health_port(scenario: Rendered) -> None:
    """The worker serves /healthz and /metrics itself on worker.healthPort."""
    app = worker_health_app([], Metrics(), 10)
    get_routes = {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}
    assert get_routes == {"/healthz", "/metrics"}

    port = worker_health_port(scenario.values)
    [worker] = pod_spec(scenario.component("Deployment", "worker"))["containers"]
    assert worker["ports"] == [{"name": "health", "containerPort": port, "protocol": "TCP"}]
    probe = worker["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "exec" not in probe
    timing = {k: v for k, v in probe.items() if k != "httpGet"}
    values_probe = scenario.values.get("worker", {}).get("livenessProbe", {})
    assert {k: v for k, v in values_probe.items() if k != "enabled"}.items() <= timing.items()
    assert set(timing) <= {
        "initialDelaySeconds",
        "periodSeconds",
        "timeoutSeconds",
        "failureThreshold",
        "successThreshold",
    }
    for mon in scenario.of_kind("PodMonitor"):
        [endpoint] = mon["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("health", "/metrics")
        settings = scenario.values["metrics"]["serviceMonitor"]
        assert endpoint["interval"] == settings.get("interval", "30s")
        assert endpoint["scrapeTimeout"] == settings.get("scrapeTimeout", "10s")
    assert bool(scenario.of_kind("PodMonitor")) == bool(scenario.of_kind("ServiceMonitor"))


def test_commands_are_ones_the_cli_accepts(scenario: Rendered) -> None:
    api = scenario.component("Deployment", "api")
    worker = scenario.component("Deployment", "worker")
    [api_container] = pod_spec(api)["containers"]
    [worker_container] = pod_spec(worker)["containers"]
    port = worker_health_port(scenario.values)
    assert worker_container["command"] == [
        *("nopoll", "worker", "--config", CONFIG_PATH),
        *("--health-port", str(port), "--health-host", "0.0.0.0"),
    ]
    assert api_container["command"] == [
        *("nopoll", "api", "--config", CONFIG_PATH),
        *("--host", "0.0.0.0", "--port", "8000"),
    ]
    parser = _parser()
    for container in containers(api) + containers(worker):
        assert container["command"][0] == "nopoll"
        args = parser.parse_args(container["command"][1:])
        assert args.config == CONFIG_PATH
    api_args = parser.parse_args(api_container["command"][1:])
    assert (api_args.command, api_args.host, api_args.port) == ("api", "0.0.0.0", 8000)
    worker_args = parser.parse_args(worker_container["command"][1:])
    assert (worker_args.command, worker_args.health_port, worker_args.health_host) == (
        "worker",
        port,
        "0.0.0.0",  # the CLI's default, 127.0.0.1, is unreachable for the kubelet
    )


def test_init_container_checks_the_config(scenario: Rendered) -> None:
    for role in ("api", "worker"):
        [init] = pod_spec(scenario.component("Deployment", role))["initContainers"]
        assert init["command"] == ["nopoll", "config", "check", "--config", CONFIG_PATH]


def test_config_map_passes_nopoll_config_check(
    scenario: Rendered,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The init container's check, with the environment the pods' Secret gives them."""
    config = tmp_path / "nopoll.yaml"
    config.write_text(scenario.config_map()["nopoll.yaml"])
    [init] = pod_spec(scenario.component("Deployment", "worker"))["initContainers"]
    env = container_env(init, scenario)
    assert env["REDIS_URL"].startswith("redis://")
    assert "$(" not in env["REDIS_URL"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    assert main(["config", "check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "redis: external" in out
    for name in scenario.values["config"]["providers"]:
        assert f"provider {name}:" in out
    for name in scenario.values["config"]["sinks"]:
        assert f"sink {name}:" in out
    settings = load_settings(config)
    assert str(settings.data_dir) == "/data"
    assert settings.redis_url.get_secret_value() == env["REDIS_URL"]


def test_no_secret_value_outside_the_secret(scenario: Rendered) -> None:
    values = scenario.values
    secrets = [*values.get("secret", {}).get("env", {}).values()]
    secrets += [values.get("redis", {}).get("url", "")]
    secrets += [values.get("redis", {}).get("bundled", {}).get("auth", {}).get("password", "")]
    secrets = [s for s in secrets if s]
    assert len(secrets) >= 3
    assert scenario.of_kind("Secret")
    for path, text in scenario.manifests.items():
        if path.endswith("/secret.yaml"):
            continue
        for secret in secrets:
            assert secret not in text, f"a secret value is in {path}"
    # The config the pods mount refers to secrets, it never holds them.
    assert "${" in scenario.config_map()["nopoll.yaml"]


def test_every_container_is_locked_down(scenario: Rendered) -> None:
    workloads = [d for d in scenario.docs if d["kind"] in POD_KINDS]
    assert len(workloads) >= 3
    for doc in workloads:
        spec = pod_spec(doc)
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        for volume in volumes.values():
            sources = set(volume) - {"name"}
            assert len(sources) == 1, f"{where}: volume {volume['name']} has sources {sources}"
        for container in containers(doc):
            sc = container["securityContext"]
            here = f"{where} container {container['name']}"
            assert sc["runAsNonRoot"] is True, here
            assert sc["runAsUser"] == 10001 and sc["runAsGroup"] == 10001, here
            assert sc["allowPrivilegeEscalation"] is False, here
            assert sc["readOnlyRootFilesystem"] is True, here
            assert sc["capabilities"] == {"drop": ["ALL"]}, here
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, here
            assert container["resources"].get("requests"), here
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            # A read-only root: /tmp is writable through an emptyDir.
            assert "emptyDir" in volumes[mounts["/tmp"]], here


def test_pods_roll_when_config_or_secret_change(render: Any) -> None:
    base = default_values()

    def checksums(values: dict[str, Any]) -> dict[str, dict[str, str]]:
        rendered = render(values)
        out = {}
        for role in ("api", "worker"):
            annotations = rendered.component("Deployment", role)["spec"]["template"]["metadata"][
                "annotations"
            ]
            out[role] = {k: v for k, v in annotations.items() if k.startswith("checksum/")}
        return out

    before = checksums(base)
    for role in ("api", "worker"):
        assert set(before[role]) == {"checksum/config", "checksum/secret"}
        assert all(len(v) == 64 for v in before[role].values())
    assert checksums(with_changes(base, api__replicas=5)) == before

    config_changed = checksums(with_changes(base, config__log_level="debug"))
    secret_changed = checksums(
        with_changes(base, secret__env={**base["secret"]["env"], "OPENAI_API_KEY": "sk-rotated"})
    )
    for role in ("api", "worker"):
        assert config_changed[role]["checksum/config"] != before[role]["checksum/config"]
        assert config_changed[role]["checksum/secret"] == before[role]["checksum/secret"]
        assert secret_changed[role]["checksum/secret"] != before[role]["checksum/secret"]
        assert secret_changed[role]["checksum/config"] == before[role]["checksum/config"]


def test_worker_liveness_probes_its_own_process(scenario: Rendered) -> None:
    [worker] = pod_spec(scenario.component("Deployment", "worker"))["containers"]
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # The probe asks the worker process itself; no probe script ships in the ConfigMap.
    assert set(scenario.config_map()) == {"nopoll.yaml"}
    assert "readinessProbe" not in worker  # workers take no traffic
    grace = pod_spec(scenario.component("Deployment", "worker"))["terminationGracePeriodSeconds"]
    shutdown_wait = scenario.values["config"].get("worker", {}).get("shutdown_wait_s", 20)
    assert grace > shutdown_wait + 5


# --- references between objects resolve ---------------------------------------------------


def test_references_between_objects_resolve(scenario: Rendered) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in scenario.docs}
    workloads = [d for d in scenario.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def pods_selected(selector: dict[str, str]) -> list[str]:
        return [
            d["metadata"]["name"]
            for d in workloads
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]

    for doc in workloads:
        assert doc["spec"]["selector"]["matchLabels"].items() <= (
            doc["spec"]["template"]["metadata"]["labels"].items()
        )
        spec = pod_spec(doc)
        for volume in spec["volumes"]:
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
        if scenario.of_kind("ServiceAccount"):
            assert ("ServiceAccount", spec["serviceAccountName"]) in names
    for svc in scenario.of_kind("Service"):
        assert len(pods_selected(svc["spec"]["selector"])) == 1, svc["metadata"]["name"]
    for pdb in scenario.of_kind("PodDisruptionBudget"):
        assert len(pods_selected(pdb["spec"]["selector"]["matchLabels"])) == 1
    for scaler in scenario.of_kind("HorizontalPodAutoscaler") + scenario.of_kind("ScaledObject"):
        target = scaler["spec"]["scaleTargetRef"]
        assert ("Deployment", target["name"]) in names
        # The autoscaler owns the replica count; the Deployment must not reset it.
        assert "replicas" not in scenario.get("Deployment", target["name"])["spec"]
    for ingress in scenario.of_kind("Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["path"].startswith("/webhooks")
                assert ("Service", path["backend"]["service"]["name"]) in names
    for mon in scenario.of_kind("ServiceMonitor"):
        selected = [
            s
            for s in scenario.of_kind("Service")
            if mon["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert [s["metadata"]["name"] for s in selected] == [
            scenario.component("Service", "api")["metadata"]["name"]
        ]
        service_ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert {e["port"] for e in mon["spec"]["endpoints"]} <= service_ports
    for mon in scenario.of_kind("PodMonitor"):
        worker = scenario.component("Deployment", "worker")
        assert pods_selected(mon["spec"]["selector"]["matchLabels"]) == [worker["metadata"]["name"]]
        container_ports = {p["name"] for c in pod_spec(worker)["containers"] for p in c["ports"]}
        assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} <= container_ports
    for policy in scenario.of_kind("NetworkPolicy"):
        pods = [
            d
            for d in workloads
            if policy["spec"]["podSelector"]["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, policy["metadata"]["name"]
        named = {p["name"] for c in pod_spec(pods[0])["containers"] for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= named, policy["metadata"]["name"]


@pytest.mark.parametrize(
    "peers",
    [[], [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]],
)
def test_network_policies_open_only_the_serving_ports(
    render: Any, peers: list[dict[str, Any]]
) -> None:
    """API: port http (from apiIngressFrom); workers: port health only (from
    workerIngressFrom); the same rule shape for both, empty meaning anyone."""
    values = with_changes(
        default_values(),
        networkPolicy={"enabled": True, "apiIngressFrom": peers, "workerIngressFrom": peers},
    )
    rendered = render(values)
    for role, port in (("api", "http"), ("worker", "health")):
        policy = rendered.component("NetworkPolicy", role)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        [rule] = policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
        if peers:
            assert rule["from"] == peers
        else:
            assert "from" not in rule
    off = render(with_changes(default_values(), networkPolicy={"enabled": False}))
    assert off.of_kind("NetworkPolicy") == []


def test_worker_health_port_serves_without_the_probe(render: Any) -> None:
    """Switching the probe off keeps the port and its /metrics (the PodMonitor scrapes it)."""
    values = with_changes(
        default_values(),
        worker__livenessProbe={"enabled": False},
        worker__healthPort=9200,
        metrics__serviceMonitor={"enabled": True},
    )
    rendered = render(values)
    [worker] = pod_spec(rendered.component("Deployment", "worker"))["containers"]
    assert "livenessProbe" not in worker
    assert worker["ports"] == [{"name": "health", "containerPort": 9200, "protocol": "TCP"}]
    assert worker["command"][-4:] == ["--health-port", "9200", "--health-host", "0.0.0.0"]
    [mon] = rendered.of_kind("PodMonitor")
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == "health"


def test_names_fit_kubernetes_limits_with_a_long_release_name(render: Any) -> None:
    release = "a-release-name-that-is-exactly-fifty-three-chars-long"
    assert len(release) == 53  # Helm's own limit
    rendered = render(load_values(SCENARIOS["all-options"]), release=release)
    seen: set[tuple[str, str]] = set()
    for doc in rendered.docs:
        name = doc["metadata"]["name"]
        limit = 52 if doc["kind"] == "StatefulSet" else 63
        assert len(name) <= limit, (doc["kind"], name)
        assert (doc["kind"], name) not in seen, (doc["kind"], name)
        seen.add((doc["kind"], name))
    deployments = {d["metadata"]["name"] for d in rendered.of_kind("Deployment")}
    assert len(deployments) == 2


# --- Redis, Secrets and the helm test ----------------------------------------------------


def test_rendering_fails_without_a_shared_redis(render: Any) -> None:
    values = default_values()
    del values["redis"]
    message = render_error(render, values)
    assert "redis.url" in message and "redis.bundled.enabled" in message
    assert "single process" in message

    both = with_changes(default_values(), redis__bundled={"enabled": True})
    assert "only one" in render_error(render, both)

    no_password = with_changes(values, redis__bundled={"enabled": True})
    assert "redis.bundled.auth.password is required" in render_error(render, no_password)


def test_bundled_redis_persists_and_pods_use_it(render: Any) -> None:
    values = default_values()
    del values["redis"]
    values["redis"] = {"bundled": {"enabled": True, "auth": {"password": "s3cret-pw"}}}
    rendered = render(values)
    sts = rendered.component("StatefulSet", "redis")
    [redis] = pod_spec(sts)["containers"]
    command = redis["command"]
    assert command[0] == "valkey-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    # a full Redis refuses writes (503, the provider retries) before the pod hits its limit
    limit = _bytes(redis["resources"]["limits"]["memory"])
    assert 0 < _bytes(command[command.index("--maxmemory") + 1]) < limit
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in redis["volumeMounts"]
    service = rendered.component("Service", "redis")["metadata"]["name"]
    [worker] = pod_spec(rendered.component("Deployment", "worker"))["containers"]
    env = container_env(worker, rendered)
    assert env["REDIS_URL"] == f"redis://:s3cret-pw@{service}.nopoll.svc:6379/0"
    assert container_env(redis, rendered)["REDIS_PASSWORD"] == "s3cret-pw"


def _bytes(quantity: str) -> int:
    """A Kubernetes (``1Gi``) or valkey (``768mb``) memory quantity in bytes."""
    units = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    number = quantity.rstrip("KMGikmgbB")
    unit = quantity[len(number) :].lower()
    return int(number) * units.get(unit, 1)


def test_existing_secret_replaces_the_chart_secret(render: Any) -> None:
    values = default_values()
    del values["secret"]
    values["redis"] = {"existingSecretKey": "REDIS_URL"}
    values["existingSecret"] = "my-nopoll-secrets"
    rendered = render(values)
    assert rendered.of_kind("Secret") == []
    for doc in rendered.of_kind("Deployment"):
        for container in containers(doc):
            assert {"secretRef": {"name": "my-nopoll-secrets"}} in container["envFrom"]
            [redis_url] = [e for e in container["env"] if e["name"] == "REDIS_URL"]
            assert redis_url["valueFrom"]["secretKeyRef"] == {
                "name": "my-nopoll-secrets",
                "key": "REDIS_URL",
            }


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (
            {"config__sinks": {"db": {"type": "sql", "url": "postgresql://app:hunter2@db/x"}}},
            "config.sinks.db.url: this URL holds a password",
        ),
        (
            {"config__sinks": {"hook": {"type": "http", "url": "https://x", "secret": "s3"}}},
            "config.sinks.hook.secret: write a ${VAR} reference",
        ),
        ({"config__sinks": {}}, "config.sinks: configure at least one sink"),
        (
            {"secret__env": {"OPENAI_API_KEY": "sk-x", "DATABASE_URL": "postgresql://db/x"}},
            "config references ${OPENAI_WEBHOOK_SECRET}, which nothing provides",
        ),
        (
            {"config__worker": {"shutdown_wait_s": 60}},
            "worker.terminationGracePeriodSeconds (45) must exceed",
        ),
        (
            {"existingSecret": "mine", "redis": {"existingSecretKey": "REDIS_URL"}},
            "secret.env: with existingSecret",
        ),
        ({"existingSecret": "mine"}, "redis.url: with existingSecret"),
        (
            {
                "api__autoscaling": {"enabled": True},
                "api__resources": {"requests": {"cpu": None}},
            },
            "needs api.resources.requests.cpu",
        ),
    ],
)
def test_rendering_refuses_unsafe_or_broken_values(
    render: Any, change: dict[str, Any], complaint: str
) -> None:
    values = with_changes(default_values(), **change)
    assert complaint in render_error(render, values)


def test_notes_list_one_webhook_url_per_provider(scenario: Rendered) -> None:
    base = scenario.values.get("publicUrl") or "https://<your public host>"
    for name in scenario.values["config"]["providers"]:
        assert f"{name}: {base}/webhooks/{name}" in scenario.notes
    assert "helm test" in scenario.notes


def test_helm_test_pod_posts_to_the_api_service(scenario: Rendered, tmp_path: Path) -> None:
    [pod] = scenario.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["python", "/etc/nopoll-test/helm_test.py"]
    env = container_env(container, scenario)
    service = scenario.component("Service", "api")
    port = service["spec"]["ports"][0]["port"]
    assert env["NOPOLL_TEST_URL"] == f"http://{service['metadata']['name']}:{port}"
    assert env["NOPOLL_CONFIG"] == CONFIG_PATH
    [script_cm] = [
        d for d in scenario.of_kind("ConfigMap") if d["metadata"]["name"] == pod["metadata"]["name"]
    ]
    assert script_cm["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert script_cm["data"]["helm_test.py"] == (CHART / "files" / "helm_test.py").read_text()
    # The test pod's environment resolves every ${VAR} of the config it signs with.
    config = tmp_path / "nopoll.yaml"
    config.write_text(scenario.config_map()["nopoll.yaml"])
    settings = load_settings(config, env=env)
    assert settings.providers.keys() == scenario.values["config"]["providers"].keys()
