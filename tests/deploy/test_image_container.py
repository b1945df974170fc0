"""The image, built with podman by scripts/image and run as users run it: a read-only root
filesystem, uid 10001, ``nopoll demo``, and ``api`` + ``worker`` containers turning a
signed callback into a row of the machine's Postgres."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from receiver.demo.simulator import send_callback
from tests.deploy.podman import Image, podman, wait_http
from tests.e2e.helpers import pg_rows, wait_for
from tests.servers import free_port

pytestmark = [pytest.mark.image, pytest.mark.timeout(1500)]

_INSIDE = r"""
import json, os, shutil, site, sys
from pathlib import Path
found = {"uid": os.getuid(), "gid": os.getgid()}
try:
    open("/nopoll-write-test", "w")
    found["root_writable"] = True
except OSError as exc:
    found["root_writable"] = exc.strerror
found["compilers"] = [t for t in ("cc", "gcc", "c++", "g++", "clang", "make", "ld", "as")
                      if shutil.which(t)]
found["caches"] = [str(p) for p in Path("/").glob("*/.cache")] + [
    p for p in ("/root/.cache", "/tmp/.cache", "/src") if os.path.exists(p)]
site_packages = Path(site.getsitepackages()[0])
found["test_packages"] = sorted(p.name for p in site_packages.iterdir()
                                if p.name in ("tests", "test", "bench"))
found["headers"] = [str(p) for p in Path("/usr/include").glob("python3*")]
print(json.dumps(found))
"""


def test_the_runtime_stage_carries_no_compilers_caches_or_tests(
    nopoll_image: Image, record_property: Any
) -> None:
    """What ships is the virtualenv on a bare Debian: no compiler, no pip cache, no source
    tree or tests; root is read-only and the process runs as 10001."""
    record_property("image_size_bytes", nopoll_image.size_bytes)
    built = [line for line in nopoll_image.build_log.splitlines() if line.startswith("==>")]
    figures = f"image {nopoll_image.ref}: {nopoll_image.size_bytes / 1e6:.0f} MB"
    record_property("figures", "\n".join([*built, figures]))
    print(figures)
    run = ("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--network", "none")
    out = podman(*run, "--entrypoint", "python", nopoll_image.ref, "-c", _INSIDE).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert (found["uid"], found["gid"]) == (10001, 10001)
    assert found["root_writable"] == "Read-only file system"
    # the inventory again as root, who can look everywhere (/root included)
    out = podman(*run, "--user", "0", "--entrypoint", "python", nopoll_image.ref, "-c", _INSIDE)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["compilers"] == []
    assert found["caches"] == []
    assert found["test_packages"] == []
    assert found["headers"] == []
    [config] = json.loads(podman("image", "inspect", nopoll_image.ref).stdout)
    assert config["Config"]["User"] == "10001:10001"


def test_demo_runs_with_a_read_only_root_as_uid_10001(nopoll_image: Image) -> None:
    result = podman(
        *("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--network", "none"),
        *(nopoll_image.ref, "demo", "--n", "20"),
        timeout=300,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "rows landed        20/20" in out, out
    assert "every result landed exactly once" in out, out


@pytest.fixture
def containers() -> Any:
    """Factory: ``podman run -d`` a container; every one (and its volume) removed at the end."""
    names: list[str] = []

    def run(name: str, *args: str) -> str:
        names.append(name)
        podman("run", "-d", "--name", name, *args)
        return name

    yield run
    for name in names:
        podman("rm", "-f", "-t", "5", name, check=False)
        podman("volume", "rm", "-f", f"{name}-data", check=False)


async def test_api_and_worker_containers_turn_a_signed_callback_into_a_row(
    nopoll_image: Image,
    containers: Any,
    redis_url: str,
    pg_url: str,
    pg_table: str,
    provider_sim: Any,
    webhook_secret: str,
    tmp_path: Path,
) -> None:
    sim = provider_sim(auto_respond=True)
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis_url": "${REDIS_URL}",
                "data_dir": "/data",
                "providers": {
                    "sim": {
                        "dialect": "openai",
                        "base_url": sim.base_url,
                        "webhook_secrets": ["${SIM_SECRET}"],
                    }
                },
                "sinks": {
                    "warehouse": {"type": "sql", "url": "${DATABASE_URL}", "table": pg_table}
                },
            }
        )
    )
    config.chmod(0o644)
    run_id = uuid.uuid4().hex[:8]
    api_port, health_port = free_port(), free_port()
    common = [
        *("--network", "host", "--read-only", "--tmpfs", "/tmp"),
        *("-v", f"{config}:/etc/nopoll/nopoll.yaml:ro"),
        *("-e", f"REDIS_URL={redis_url}", "-e", f"SIM_SECRET={webhook_secret}"),
        *("-e", f"DATABASE_URL={pg_url}", "-e", "NOPOLL_CONFIG=/etc/nopoll/nopoll.yaml"),
    ]
    for role, args in (
        ("api", ["api", "--host", "127.0.0.1", "--port", str(api_port)]),
        ("worker", ["worker", "--health-host", "127.0.0.1", "--health-port", str(health_port)]),
    ):
        name = f"np{run_id}-{role}"
        containers(name, *common, "-v", f"{name}-data:/data", nopoll_image.ref, *args)
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{api_port}/readyz")
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{health_port}/healthz")

    response_id = f"resp_image_{run_id}"
    url = f"http://127.0.0.1:{api_port}/webhooks/sim"
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await send_callback(client, url, webhook_secret, response_id)
    assert answer.status_code == 202, answer.text

    async def landed() -> list[dict[str, Any]]:
        return await pg_rows(pg_url, pg_table)

    rows = await wait_for(landed, timeout=60)
    assert [(r["provider"], r["key"], r["status"]) for r in rows] == [
        ("sim", response_id, "completed")
    ]
