"""The Helm chart, rendered by Helm's own engine: lint, the values schema, and valid
Kubernetes manifests for every combination of values (what the pods run:
test_chart_pods.py; Redis, Secrets and the helm test: test_chart_secrets.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from receiver.config.dialects import DIALECTS
from receiver.config.settings import (
    ApiConfig,
    BatchConfig,
    HttpConfig,
    ProviderConfig,
    RetryConfig,
    RouteConfig,
    RouteMatch,
    Settings,
    TenantProviderConfig,
    UiConfig,
    WorkerConfig,
    load_settings,
)
from tests.deploy.chart import (
    CHART,
    CUSTOM_RESOURCES,
    KUBE_VERSIONS,
    SCENARIOS,
    Rendered,
    container_env,
    default_values,
    load_values,
    pod_spec,
    with_changes,
)

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
    import jsonschema

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


def test_a_provider_without_callbacks_is_accepted(helm: Any, render: Any) -> None:
    """Sail and Valar send no webhooks: a provider with no webhook_secrets (watched only)
    passes the schema and renders."""
    values = copy.deepcopy(default_values())
    values["config"]["providers"] = {
        "sail": {"dialect": "sail", "base_url": "https://api.sail.example/v1"},
        "valar": {"dialect": "valar", "base_url": "https://x", "webhook_secrets": []},
    }
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
    assert "sail:" in render(values).config_map()["nopoll.yaml"]


def test_a_request_budget_is_a_number_or_null(helm: Any) -> None:
    """``rate_limit_rps`` of a provider and of a tenant's account: a rate, or null for no
    budget (what a valar provider pointed at a simulator needs); 0 is refused."""
    values = copy.deepcopy(default_values())
    values["config"]["providers"] = {
        "valar": {"dialect": "valar", "base_url": "https://x", "rate_limit_rps": None},
        "more": {"dialect": "valar", "base_url": "https://y", "rate_limit_rps": 5},
    }
    values["config"]["tenants"] = {
        "team-a": {"providers": {"valar": {"api_key": "${TEAM_A_KEY}", "rate_limit_rps": 0.5}}}
    }
    values["config"]["tenant_keys"] = ["${TENANT_KEY}"]
    values["secret"]["env"].update({"TEAM_A_KEY": "sk-a", "TENANT_KEY": "k" * 32})
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        values["config"]["providers"]["more"]["rate_limit_rps"] = 0
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)


def test_schema_dialect_enum_is_the_dialect_table() -> None:
    """The chart's ``dialect`` enum names every row of the dialect table, in its order, and
    nothing else: a new dialect fails here until the chart takes it."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    provider = schema["properties"]["config"]["properties"]["providers"]["additionalProperties"]
    assert provider["properties"]["dialect"]["enum"] == list(DIALECTS)


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
    tenant = config["properties"]["tenants"]["additionalProperties"]["properties"]
    assert keys(tenant["providers"]["additionalProperties"]) == set(
        TenantProviderConfig.model_fields
    )
    assert keys(config["properties"]["fetch_retry"]) == set(RetryConfig.model_fields)
    assert keys(config["properties"]["sink_retry"]) == set(RetryConfig.model_fields)
    assert keys(config["properties"]["http"]) == set(HttpConfig.model_fields)
    assert keys(config["properties"]["worker"]) == set(WorkerConfig.model_fields)
    assert keys(config["properties"]["batch"]) == set(BatchConfig.model_fields)
    assert keys(config["properties"]["api"]) == set(ApiConfig.model_fields)
    assert keys(config["properties"]["ui"]) == set(UiConfig.model_fields)
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
        fields = "selector podMetricsEndpoints namespaceSelector jobLabel podTargetLabels"
        assert set(mon["spec"]) <= set(fields.split())
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


def test_an_existing_sentinel_set_and_replica_acks_render_into_secret_and_config(
    helm: Any, render: Any, tmp_path: Path
) -> None:
    """redis.url may name a Sentinel set (it goes to the Secret, as any Redis URL); the
    config's redis section takes min_replicas_acked, and the loaded config is valid."""
    values = copy.deepcopy(default_values())
    url = "redis+sentinel://:pw@sentinel-0:26379,sentinel-1:26379/mymaster/0"
    values["redis"]["url"] = url
    values["config"]["redis"] = {"min_replicas_acked": 1, "wait_timeout_ms": 800}
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        values["config"]["redis"]["min_replicas_acked"] = -1
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
        values["config"]["redis"]["min_replicas_acked"] = 1
    rendered = render(values)
    assert any(env.get("REDIS_URL") == url for env in rendered.secrets().values())
    config = rendered.config_map()["nopoll.yaml"]

    path = tmp_path / "nopoll.yaml"
    path.write_text(config)
    settings = load_settings(path, env={"REDIS_URL": url, **values["secret"]["env"]})
    assert settings.redis.min_replicas_acked == 1 and settings.redis.wait_timeout_ms == 800
    assert settings.redis.url.get_secret_value() == url


# --- the consumers' API Deployment -------------------------------------------------------

_SPLIT_HOSTS = [
    {
        "host": "h.example.com",
        "paths": [
            {"path": "/webhooks", "pathType": "Prefix"},
            {"path": "/v1", "pathType": "Prefix", "component": "consumers"},
        ],
    }
]
"""An ingress host with the callbacks' path and one path marked for the consumers."""


def test_without_consumers_one_api_deployment_serves_every_path(render: Any) -> None:
    values = with_changes(
        default_values(),
        ingress__enabled=True,
        ingress__hosts=_SPLIT_HOSTS,
    )
    rendered = render(values)
    components = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in rendered.of_kind("Deployment") + rendered.of_kind("Service")
    }
    assert "consumers" not in components
    [ingress] = rendered.of_kind("Ingress")
    api = rendered.component("Service", "api")["metadata"]["name"]
    paths = ingress["spec"]["rules"][0]["http"]["paths"]
    backends = [p["backend"]["service"]["name"] for p in paths]
    assert backends == [api, api]  # a path marked consumers goes to the API when there is none


def test_consumers_run_their_own_api_pods_behind_their_own_service(render: Any) -> None:
    """The mitigation docs/security.md measures: providers' callbacks and consumers' reads
    on separate API processes. The consumers' pods run the same `nopoll api` with the same
    config, take what they do not set from api, and only their paths reach them."""
    values = with_changes(
        default_values(),
        consumers__enabled=True,
        consumers__replicas=3,
        consumers__resources={"requests": {"cpu": "300m"}},
        api__podDisruptionBudget={"enabled": True, "maxUnavailable": 1},
        ingress__enabled=True,
        ingress__hosts=_SPLIT_HOSTS,
    )
    rendered = render(values)
    api, consumers = (rendered.component("Deployment", c) for c in ("api", "consumers"))
    api_pod, consumers_pod = pod_spec(api), pod_spec(consumers)
    assert consumers_pod["containers"][0]["command"] == api_pod["containers"][0]["command"]
    assert consumers_pod["volumes"] == api_pod["volumes"]  # the same config and secrets
    assert consumers["spec"]["replicas"] == 3 and api["spec"]["replicas"] == 2
    resources = consumers_pod["containers"][0]["resources"]
    api_resources = api_pod["containers"][0]["resources"]
    # merged key by key: its own cpu request, the api's memory request and limits
    assert resources["requests"] == {"cpu": "300m", "memory": api_resources["requests"]["memory"]}
    assert resources["limits"] == api_resources["limits"]
    assert (
        consumers_pod["containers"][0]["readinessProbe"]
        == (api_pod["containers"][0]["readinessProbe"])
    )
    labels = consumers["spec"]["template"]["metadata"]["labels"]
    service = rendered.component("Service", "consumers")
    assert service["spec"]["selector"].items() <= labels.items()
    assert not rendered.component("Service", "api")["spec"]["selector"].items() <= labels.items()
    [ingress] = rendered.of_kind("Ingress")
    routed = {
        p["path"]: p["backend"]["service"]["name"]
        for p in ingress["spec"]["rules"][0]["http"]["paths"]
    }
    assert routed == {
        "/webhooks": rendered.component("Service", "api")["metadata"]["name"],
        "/v1": service["metadata"]["name"],
    }
    budgets = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]
        for p in rendered.of_kind("PodDisruptionBudget")
    }
    assert budgets["consumers"]["maxUnavailable"] == 1  # taken from api
    assert f"behind\nthe service {service['metadata']['name']}:" in rendered.notes
    assert not [h for h in rendered.of_kind("HorizontalPodAutoscaler") if "consumers" in str(h)]
