"""Running the image and the chart's pods for real, with podman.

The image is built by ``scripts/image`` (a Debian base made with debootstrap: no container
registry is reachable from the test machines), once per build context: its tag is a hash
of the context, so a run reuses the image an earlier run built from the same code.

The chart's manifests are played with ``podman kube play`` after the adjustments podman
needs on these machines (docs/deployment.md, "Trying it on a laptop"): a Secret becomes a
podman secret first; the config-check init container runs once as its own pod; each
replica is its own one-replica Deployment on the host network with its own port (set in
the values, api.port or worker.healthPort, and bound to 127.0.0.1); probes and the preStop
hook are done by the test; every emptyDir gets a name of its own pod; pods are stopped
with the chart's grace period. Everything started is removed by name at the end, even
when a test fails.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.newer import newer_jobs_source
from tests.servers import missing

ROOT = Path(__file__).resolve().parents[2]
IMAGE_SCRIPT = ROOT / "scripts" / "image"


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.returncode}\n{result.stderr}")
    return result


def require(*tools: str) -> None:
    """Fail in CI (skip elsewhere) when a tool is missing, naming how to get it."""
    for tool in tools:
        if shutil.which(tool) is None:
            missing(f"{tool} is not installed: ./scripts/test installs it (Debian package)")


@dataclass(frozen=True)
class Image:
    ref: str
    size_bytes: int
    build_log: str


@pytest.fixture(scope="session")
def nopoll_image() -> Image:
    """nopoll's image, built by scripts/image (or reused when its build context is unchanged)."""
    require("podman", "runc", "debootstrap")
    result = subprocess.run(
        [str(IMAGE_SCRIPT)], capture_output=True, text=True, timeout=1200, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/image failed:\n{result.stderr[-4000:]}")
    ref = result.stdout.strip().splitlines()[-1]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())
    report = [line for line in result.stderr.splitlines() if line.startswith("==>")]
    print("\n".join(report))
    return Image(ref, size, result.stderr)


@pytest.fixture(scope="session")
def newer_image(nopoll_image: Image, tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The next nopoll's image, as a rolling upgrade meets it: nopoll_image with the job
    payload and batch-progress versions raised (tests/newer.py), tagged with a hash of
    what it is made from and reused like nopoll_image."""
    source = newer_jobs_source()
    tag = hashlib.sha256(f"{nopoll_image.ref}\n{source}".encode()).hexdigest()[:16]
    ref = f"localhost/nopoll-newer:{tag}"
    if podman("image", "exists", ref, check=False).returncode != 0:
        where = podman(
            "run", "--rm", "--entrypoint", "python", nopoll_image.ref,
            "-c", "import receiver.queue.jobs as j; print(j.__file__)",
        ).stdout.strip()  # fmt: skip
        context = tmp_path_factory.mktemp("newer-image")
        (context / "jobs.py").write_text(source)
        (context / "Containerfile").write_text(f"FROM {nopoll_image.ref}\nCOPY jobs.py {where}\n")
        podman("build", "-t", ref, "-f", str(context / "Containerfile"), str(context), timeout=300)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())
    return Image(ref, size, "")


# --- the chart's pods under podman kube play ---------------------------------------------


def _dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def _set_option(command: list[str], option: str, value: str) -> list[str]:
    out = list(command)
    out[out.index(option) + 1] = value
    return out


@dataclass
class Pod:
    """One played pod: its name, its file, its volumes, and how it ends."""

    name: str
    path: Path
    volumes: list[str]
    grace_s: int = 30
    port: int | None = None
    pre_stop: list[str] | None = None
    container: str = ""


@dataclass
class KubePlay:
    """Plays the chart's objects with podman; :meth:`close` removes all it made, by name."""

    work: Path
    release: str
    config_maps: list[dict[str, Any]]
    pods: dict[str, Pod] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    config_map_names: dict[str, str] = field(default_factory=dict)
    config_map_volumes: set[str] = field(default_factory=set)

    def release_config_maps(self, rendered: Any, revision: int) -> list[dict[str, Any]]:
        """The release's ConfigMaps for one revision, named after it: podman keeps a
        ConfigMap's files in a volume of that name, which pods of two revisions share."""
        maps = []
        for doc in rendered.of_kind("ConfigMap"):
            if "grafana_dashboard" in doc["metadata"].get("labels", {}):
                continue
            doc = copy.deepcopy(doc)
            doc["metadata"].pop("annotations", None)
            name = doc["metadata"]["name"]
            self.config_map_names[name] = doc["metadata"]["name"] = f"{name}-r{revision}"
            self.config_map_volumes.add(f"{name}-r{revision}")
            maps.append(doc)
        return maps

    def create_secret(self, secret: dict[str, Any]) -> None:
        """A podman secret named like the Secret, holding the JSON map of its data."""
        name = secret["metadata"]["name"]
        path = self.work / f"secret-{name}.json"
        path.write_text(json.dumps(secret.get("data") or {}))
        path.chmod(0o600)
        podman("secret", "rm", name, check=False)
        podman("secret", "create", name, str(path))
        path.unlink()
        self.secrets.append(name)

    def _pod_doc(
        self,
        doc: dict[str, Any],
        name: str,
        *,
        init_only: bool = False,
    ) -> tuple[dict[str, Any], list[str], list[str] | None]:
        """``doc`` (Deployment or Pod) as podman can play it: one replica called ``name``."""
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = name
        doc["metadata"].pop("annotations", None)
        if doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = 1
            spec = doc["spec"]["template"]["spec"]
        else:
            spec = doc["spec"]
        spec["hostNetwork"] = True
        if init_only:  # the init container, alone, once, as its own pod
            spec["containers"] = spec.pop("initContainers")
            spec["restartPolicy"] = "Never"
            doc = {"apiVersion": "v1", "kind": "Pod", "metadata": doc["metadata"], "spec": spec}
        spec.pop("initContainers", None)
        pre_stop = None
        renamed = {}
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                cm = volume["configMap"]
                cm["name"] = self.config_map_names.get(cm["name"], cm["name"])
            if "emptyDir" in volume:  # podman: one machine-wide volume per name
                renamed[volume["name"]] = volume["name"] = f"{name}-{volume['name']}"
        for container in spec["containers"]:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                container.pop(probe, None)  # podman makes them curl checks: the test probes
            pre_stop = (
                container.pop("lifecycle", {})
                .get("preStop", {})
                .get("exec", {})
                .get("command", pre_stop)
            )
            container.pop("ports", None)  # the host network: the command says the port
            command = container.get("command", [])
            if "--host" in command:  # on the host network: this machine only
                command = _set_option(command, "--host", "127.0.0.1")
            if "--health-host" in command:
                command = _set_option(command, "--health-host", "127.0.0.1")
            container["command"] = command
            for mount in container.get("volumeMounts", []):
                mount["name"] = renamed.get(mount["name"], mount["name"])
        return doc, list(renamed.values()), pre_stop

    def play(
        self,
        doc: dict[str, Any],
        name: str,
        *,
        port: int | None = None,
        init_only: bool = False,
        env: dict[str, str] | None = None,
    ) -> Pod:
        """Play ``doc`` as the pod ``name``; ``port`` is where the test probes it (the
        chart's command says where it listens)."""
        played, volumes, pre_stop = self._pod_doc(doc, name, init_only=init_only)
        spec = played["spec"] if played["kind"] == "Pod" else played["spec"]["template"]["spec"]
        for key, value in (env or {}).items():
            for container in spec["containers"]:
                container.setdefault("env", [])
                container["env"] = [e for e in container["env"] if e["name"] != key]
                container["env"].append({"name": key, "value": value})
        path = self.work / f"{name}.yaml"
        path.write_text(_dump([*self.config_maps, played]))
        grace = int(spec.get("terminationGracePeriodSeconds", 30))
        pod = Pod(name, path, volumes, grace, port, pre_stop)
        self.pods[name] = pod
        podman("kube", "play", str(path), timeout=180)
        [container] = spec["containers"]
        pod.container = f"{self.pod_name(pod)}-{container['name']}"
        return pod

    @staticmethod
    def pod_name(pod: Pod) -> str:
        """podman names a Deployment's pod <name>-pod-0 and a Pod's pod <name>."""
        found = podman("pod", "ps", "--format", "{{.Name}}").stdout.split()
        for candidate in (f"{pod.name}-pod-0", pod.name):
            if candidate in found:
                return candidate
        raise AssertionError(f"no pod for {pod.name} in {found}")

    def wait_exit(self, pod: Pod, timeout_s: float = 120) -> tuple[int, str]:
        """The exit status and the logs of a pod's container that runs once."""
        code = podman("wait", pod.container, timeout=timeout_s).stdout.strip()
        logs = podman("logs", pod.container).stdout + podman("logs", pod.container).stderr
        return int(code.splitlines()[-1]), logs

    def logs(self, pod: Pod) -> str:
        result = podman("logs", pod.container, check=False)
        return result.stdout + result.stderr

    def pre_stop(self, pod: Pod) -> None:
        """The preStop hook, as the kubelet runs it: in the container, before SIGTERM."""
        if pod.pre_stop:
            podman("exec", pod.container, *pod.pre_stop, timeout=pod.grace_s + 10)

    def stop(self, pod: Pod, *, grace_s: float | None = None) -> None:
        """SIGTERM, SIGKILL after the grace period; then the pod and its volumes go."""
        grace = pod.grace_s if grace_s is None else max(0, int(grace_s))
        podman("pod", "stop", "-t", str(grace), self.pod_name(pod), timeout=grace + 60)
        self.remove(pod)

    def remove(self, pod: Pod) -> None:
        podman("kube", "down", str(pod.path), timeout=60, check=False)
        for volume in pod.volumes:
            podman("volume", "rm", "-f", volume, check=False)
        self.pods.pop(pod.name, None)

    def close(self) -> None:
        for pod in list(self.pods.values()):
            podman("pod", "rm", "-f", "-t", "0", f"{pod.name}-pod-0", check=False)
            podman("pod", "rm", "-f", "-t", "0", pod.name, check=False)
            self.remove(pod)
        for name in self.secrets:
            podman("secret", "rm", name, check=False)
        self.secrets.clear()
        for name in sorted(self.config_map_volumes):  # every revision's
            podman("volume", "rm", "-f", name, check=False)


@pytest.fixture
def kube_play(tmp_path: Path) -> Iterator[Any]:
    """Factory: a :class:`KubePlay` for a rendered release; all of it removed at the end."""
    made: list[KubePlay] = []

    def make(rendered: Any, release: str) -> KubePlay:
        play = KubePlay(tmp_path, release, [])
        play.config_maps = play.release_config_maps(rendered, 0)
        made.append(play)
        for secret in rendered.of_kind("Secret"):
            play.create_secret(secret)
        return play

    try:
        yield make
    finally:
        for play in made:
            play.close()


def release_name() -> str:
    """A release name no other run on the machine uses (podman names are machine-wide)."""
    return f"np{uuid.uuid4().hex[:8]}"


def wait_http(url: str, *, limit_s: float = 60, pod: Pod | None = None) -> httpx.Response:
    """GET ``url`` until it answers 200 (bounded): the probe, done by the test."""
    deadline = time.monotonic() + limit_s
    last: Any = "no answer"
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url, timeout=2)
            if answer.status_code == 200:
                return answer
            last = f"{answer.status_code} {answer.text[:200]}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    where = f" (pod {pod.name})" if pod else ""
    raise AssertionError(f"{url}{where} did not answer 200 within {limit_s} s: {last}")
