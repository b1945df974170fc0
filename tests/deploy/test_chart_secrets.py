"""The Helm chart's Redis (shared or bundled), its Secrets, values it refuses, NOTES and
the helm test pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from receiver.config.settings import (
    load_settings,
)
from tests.deploy.chart import (
    CHART,
    CONFIG_PATH,
    Rendered,
    container_env,
    containers,
    default_values,
    pod_spec,
    render_error,
    with_changes,
)

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
