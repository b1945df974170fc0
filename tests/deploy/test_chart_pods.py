"""The Helm chart's pods: probes, commands and config the app accepts, locked-down
containers, rolling on change, and references between objects that resolve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from receiver.app import create_app
from receiver.cli import _parser, main
from receiver.config.settings import (
    ApiConfig,
    load_settings,
)
from receiver.metrics import Metrics
from receiver.runtime import worker_health_app
from tests.deploy.chart import (
    CONFIG_PATH,
    POD_KINDS,
    SCENARIOS,
    Rendered,
    container_env,
    containers,
    default_values,
    load_values,
    pod_spec,
    render_error,
    selects,
    with_changes,
    worker_health_port,
)

# --- what the pods run -------------------------------------------------------------------


def test_api_probes_hit_routes_the_app_serves(scenario: Rendered, tmp_path: Path) -> None:
    settings = load_settings(None, env={}, overrides={"data_dir": str(tmp_path)})
    app = create_app(settings, redis=Redis.from_url("redis://127.0.0.1:9/0"), metrics=Metrics())
    get_routes = {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}

    [api] = pod_spec(scenario.component("Deployment", "api"))["containers"]
    port = scenario.values.get("api", {}).get("port", 8000)  # values.yaml's default
    assert api["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
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
    api_port = scenario.values.get("api", {}).get("port", 8000)
    assert worker_container["command"] == [
        *("nopoll", "worker", "--config", CONFIG_PATH),
        *("--health-port", str(port), "--health-host", "0.0.0.0"),
    ]
    assert api_container["command"] == [
        *("nopoll", "api", "--config", CONFIG_PATH),
        *("--host", "0.0.0.0", "--port", str(api_port)),
    ]
    parser = _parser()
    for container in containers(api) + containers(worker):
        assert container["command"][0] == "nopoll"
        args = parser.parse_args(container["command"][1:])
        assert args.config == CONFIG_PATH
    api_args = parser.parse_args(api_container["command"][1:])
    assert (api_args.command, api_args.host, api_args.port) == ("api", "0.0.0.0", api_port)
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


def test_ingress_trusted_proxies_become_the_apis_trusted_proxies(render: Any) -> None:
    """ingress.trustedProxies is written to config.api.trusted_proxies, beside the other
    api settings; unset, the API trusts no X-Forwarded-For; both set is refused."""

    def api(values: dict[str, Any]) -> ApiConfig:
        return ApiConfig(**yaml.safe_load(render(values).config_map()["nopoll.yaml"])["api"])

    base = with_changes(default_values(), config__api={"client_rps": 50})
    assert api(base).trusted_proxies == []
    values = with_changes(base, ingress__trustedProxies=["10.244.0.0/16", "192.168.1.7"])
    assert api(values).trusted_proxies == ["10.244.0.0/16", "192.168.1.7/32"]
    assert api(values).client_rps == 50
    both = with_changes(values, config__api={"trusted_proxies": ["10.0.0.0/8"]})
    assert "ingress.trustedProxies" in render_error(render, both)


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


def _workloads(scenario: Rendered) -> list[dict[str, Any]]:
    return [d for d in scenario.docs if d["kind"] in ("Deployment", "StatefulSet")]


def _pods_selected(scenario: Rendered, selector: dict[str, Any]) -> list[str]:
    """The workloads whose pods ``selector`` matches."""
    return [
        d["metadata"]["name"]
        for d in _workloads(scenario)
        if selects(selector, d["spec"]["template"]["metadata"]["labels"])
    ]


def test_references_between_objects_resolve(scenario: Rendered) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in scenario.docs}
    workloads = _workloads(scenario)

    def pods_selected(selector: dict[str, str]) -> list[str]:
        return _pods_selected(scenario, selector)

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
    api_service = scenario.component("Service", "api")["metadata"]["name"]
    for ingress in scenario.of_kind("Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert ("Service", path["backend"]["service"]["name"]) in names
                if path["path"].startswith("/webhooks"):  # callbacks: the providers' API
                    assert path["backend"]["service"]["name"] == api_service
    for policy in scenario.of_kind("NetworkPolicy"):
        pods = [
            d
            for d in workloads
            if selects(policy["spec"]["podSelector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert pods, policy["metadata"]["name"]
        for pod in pods:  # the API's and the consumers' pods share one policy
            named = {p["name"] for c in pod_spec(pod)["containers"] for p in c.get("ports", [])}
            for rule in policy["spec"]["ingress"]:
                assert {p["port"] for p in rule["ports"]} <= named, policy["metadata"]["name"]


def test_monitors_select_the_ports_that_serve_metrics(scenario: Rendered) -> None:
    for mon in scenario.of_kind("ServiceMonitor"):
        selected = [
            s
            for s in scenario.of_kind("Service")
            if selects(mon["spec"]["selector"], s["metadata"]["labels"])
        ]
        api_services = [
            s["metadata"]["name"]
            for s in scenario.of_kind("Service")
            if s["metadata"]["labels"]["app.kubernetes.io/component"] in ("api", "consumers")
        ]
        assert [s["metadata"]["name"] for s in selected] == api_services
        for service in selected:
            service_ports = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in mon["spec"]["endpoints"]} <= service_ports
    for mon in scenario.of_kind("PodMonitor"):
        worker = scenario.component("Deployment", "worker")
        selector = mon["spec"]["selector"]["matchLabels"]
        assert _pods_selected(scenario, selector) == [worker["metadata"]["name"]]
        container_ports = {p["name"] for c in pod_spec(worker)["containers"] for p in c["ports"]}
        assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} <= container_ports


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
    assert len(deployments) == 3  # the API, the consumers' API, the workers
