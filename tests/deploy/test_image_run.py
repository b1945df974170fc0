"""The image's install and entrypoint, step by step, without a container engine.

The build context is what .dockerignore lets through, the builder stage's COPY and
``pip install`` run into a fresh virtualenv, and the entrypoint starts the API and the
worker the way the chart does, with the chart's rendered config, commands and scripts.
The image itself is built with podman and run in test_image_container.py (marker
``image``); this module gives quicker, narrower answers without one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from receiver.cli import _parser
from tests.deploy.chart import (
    CONFIG_PATH,
    ROOT,
    SCENARIOS,
    Rendered,
    container_env,
    load_values,
    pod_spec,
)
from tests.deploy.dockerfile import build_context, stages
from tests.servers import IN_CI, free_port

# --- the install and the entrypoint, for real --------------------------------------------


def test_every_dependency_the_image_installs_is_pinned(image_venv: Path) -> None:
    """A later build installs the same versions: constraints.txt pins everything the image
    gets (./scripts/lock rewrites it when pyproject's dependencies change)."""
    frozen = subprocess.run(
        [str(image_venv / "bin" / "pip"), "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    installed = {line.lower() for line in frozen if not line.lower().startswith("nopoll")}
    pins = {
        line.strip().lower()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert installed and installed <= pins, sorted(installed - pins)


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv built as the Dockerfile's builder stage builds /opt/venv."""
    work = tmp_path_factory.mktemp("image")
    src = work / "src"
    for rel in build_context():
        target = src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [install] = [r for w, r in stages()["builder"] if w == "RUN" and "pip install" in r]
    args = [a.replace(".", str(src), 1) if a.startswith(".") else a for a in shlex.split(install)]
    result = subprocess.run(
        [str(venv / "bin" / "pip"), *args[1:], "--quiet", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=src,  # the builder's WORKDIR: constraints.txt is found where the image finds it
    )
    if result.returncode != 0:
        reason = f"pip install of the build context failed:\n{result.stderr[-3000:]}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)  # e.g. no network to the package index on this machine
    return venv


def _pod_environment(rendered: Rendered, redis_url: str, home: Path) -> dict[str, str]:
    """The API pod's environment from the rendered Secret, pointed at a local Redis."""
    [api] = pod_spec(rendered.component("Deployment", "api"))["containers"]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "SYSTEMROOT")}
    env.update(container_env(api, rendered))
    env.update(REDIS_URL=redis_url, HOME=str(home), TMPDIR=str(home), PYTHONDONTWRITEBYTECODE="1")
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _with_option(command: list[str], option: str, value: str) -> list[str]:
    """``command`` with the value after ``option`` replaced."""
    out = list(command)
    out[out.index(option) + 1] = value
    return out


def _run(venv: Path, args: list[str], env: dict[str, str], cwd: Path) -> Any:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@dataclass
class _Pod:
    """The chart's default pod set-up, outside a cluster: config, environment, scripts."""

    rendered: Rendered
    config: dict[str, Any]
    config_path: Path
    env: dict[str, str]
    data: Path


def _pod(render: Any, redis_url: str, tmp_path: Path) -> _Pod:
    rendered = render(load_values(SCENARIOS["default"]))
    data = tmp_path / "data"
    data.mkdir()
    config = yaml.safe_load(rendered.config_map()["nopoll.yaml"])
    config["data_dir"] = str(data)  # /data in the pod
    config_path = tmp_path / "nopoll.yaml"
    config_path.write_text(yaml.safe_dump(config))
    [test_cm] = [
        d
        for d in rendered.of_kind("ConfigMap")
        if "helm.sh/hook" in d["metadata"].get("annotations", {})
    ]
    (tmp_path / "helm_test.py").write_text(test_cm["data"]["helm_test.py"])
    env = _pod_environment(rendered, redis_url, tmp_path)  # the suite's own database
    env["NOPOLL_CONFIG"] = str(config_path)
    return _Pod(rendered, config, config_path, env, data)


def _get_until_ok(url: str, process: subprocess.Popen[bytes], pause_s: float) -> Any:
    """GET ``url`` until it answers 200, the process ends, or 30 s pass: the last answer."""
    deadline = time.monotonic() + 30
    answer: httpx.Response | None = None
    while time.monotonic() < deadline and process.poll() is None:
        try:
            answer = httpx.get(url, timeout=2)
            if answer.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(pause_s)
    return answer


def _start(venv: Path, command: list[str], pod: _Pod, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(venv / "bin" / command[0]), *command[1:]],
        env=pod.env,
        cwd=pod.data,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
@pytest.mark.timeout(360)  # a fresh machine downloads every dependency once
def test_installed_image_runs_api_worker_probes_and_helm_test(
    image_venv: Path, render: Any, redis_url: str, tmp_path: Path
) -> None:
    # Only what the image's builder installs: nopoll with the postgres extra, no test tools.
    probe_install = (
        "import asyncpg, nopoll, receiver, sinks, importlib.util as u; "
        "print(u.find_spec('pytest'), u.find_spec('ruff'), u.find_spec('mypy'))"
    )
    check = _run(image_venv, ["python", "-c", probe_install], {}, tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["None", "None", "None"]

    pod = _pod(render, redis_url, tmp_path)
    # The init container.
    check_config = ["nopoll", "config", "check", "--config", str(pod.config_path)]
    checked = _run(image_venv, check_config, pod.env, pod.data)
    assert checked.returncode == 0, checked.stderr
    assert "provider openai" in checked.stdout

    _api_and_helm_test(image_venv, pod, tmp_path)
    _worker_probes(image_venv, pod, tmp_path)


def _api_and_helm_test(image_venv: Path, pod: _Pod, tmp_path: Path) -> None:
    """The API Deployment's command answers its probes, and the helm test pod's script
    passes against it."""

    def logs() -> str:
        return (tmp_path / "api.log").read_text(errors="replace")

    port = free_port()
    log = (tmp_path / "api.log").open("wb")
    command = ["nopoll", "api", "--config", str(pod.config_path), "--host", "127.0.0.1"]
    api = _start(image_venv, [*command, "--port", str(port)], pod, log)
    try:
        base = f"http://127.0.0.1:{port}"
        answer = _get_until_ok(f"{base}/healthz", api, 0.1)
        status = answer.status_code if answer is not None else None
        assert status == 200, f"/healthz never answered 200:\n{logs()}"
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200

        # The helm test pod's script, against the running API.
        test_env = {**pod.env, "NOPOLL_TEST_URL": base}
        test = _run(image_venv, ["python", str(tmp_path / "helm_test.py")], test_env, tmp_path)
        assert test.returncode == 0, test.stdout + test.stderr + logs()
        assert "ok: openai: a signed test callback answers 202" in test.stdout
        assert "ok: openai: a forged signature answers 401" in test.stdout
    finally:
        _stop(api)
        log.close()
    assert api.returncode == 0, logs()  # SIGTERM is a clean shutdown


def _worker_probes(image_venv: Path, pod: _Pod, tmp_path: Path) -> None:
    """The worker Deployment's command, with its own health port: the liveness probe's
    GET /healthz answers 200 once this process's poll loops turn, and /metrics is what
    the PodMonitor scrapes."""
    [worker_container] = pod_spec(pod.rendered.component("Deployment", "worker"))["containers"]
    rendered_command = worker_container["command"]
    args = _parser().parse_args(rendered_command[1:])
    assert (args.command, args.config, args.health_host) == ("worker", CONFIG_PATH, "0.0.0.0")
    assert args.health_port == worker_container["ports"][0]["containerPort"]
    assert worker_container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}

    config = pod.config
    config["sinks"] = {"files": {"type": "jsonl", "dir": str(pod.data / "results")}}
    config["worker"] = {"health_check_interval_s": 1, "shutdown_wait_s": 1}
    pod.config_path.write_text(yaml.safe_dump(config))
    health_port = free_port()
    command = _with_option(rendered_command, "--config", str(pod.config_path))
    command = _with_option(command, "--health-port", str(health_port))
    command = _with_option(command, "--health-host", "127.0.0.1")  # 0.0.0.0 in the pod
    worker_log = (tmp_path / "worker.log").open("wb")
    worker = _start(image_venv, command, pod, worker_log)

    def worker_logs() -> str:
        return (tmp_path / "worker.log").read_text(errors="replace")

    try:
        health = f"http://127.0.0.1:{health_port}"
        answer = _get_until_ok(f"{health}/healthz", worker, 0.2)
        assert answer is not None and answer.status_code == 200, (
            f"the worker's /healthz never answered 200 "
            f"({answer.status_code if answer else 'no answer'}):\n{worker_logs()}"
        )
        report = answer.json()
        assert report["ok"] is True, report
        ages = report["poll_loop_age_s"]
        assert "nopoll:jobs" in ages and all(isinstance(a, float | int) for a in ages.values())
        metrics = httpx.get(f"{health}/metrics", timeout=5)
        assert metrics.status_code == 200, metrics.text
        assert metrics.headers["content-type"].startswith("text/plain")
        for name in ("nopoll_jobs_total", "nopoll_sink_writes_total", "nopoll_dead_letters_total"):
            assert name in metrics.text, name
    finally:
        _stop(worker)
        worker_log.close()
    assert worker.returncode == 0, worker_logs()  # SIGTERM is a clean shutdown
