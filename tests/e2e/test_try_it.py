"""``nopoll simulate`` + ``nopoll serve`` + ``nopoll send-test``, as the README's "Try it with
your own config" runs them: separate ``nopoll`` processes, the config pasted from what
``simulate`` printed."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.helpers import NOPOLL, run_nopoll, wait_ready
from tests.servers import free_port

pytestmark = pytest.mark.slow

BATCH_ROWS = 25


@dataclass
class Started:
    """nopoll processes started by a test, each stopped by its PID at the end."""

    cwd: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.cwd / f"{name}.out"
        with out.open("wb") as f:
            p = subprocess.Popen(
                [NOPOLL, *args],
                cwd=self.cwd,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append(p)
        return p, out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NOPOLL_", "SIM_", "AWS_")) or k.startswith("NOPOLL_TEST_")
    }


def _wait_for_output(out: Path, proc: subprocess.Popen[bytes], needle: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = out.read_text(errors="replace") if out.exists() else ""
        if needle in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} never printed:\n{out.read_text(errors='replace')}")


@dataclass
class Simulated:
    text: str
    base_url: str
    exports: dict[str, str]
    config_block: str


def _parse_simulate(text: str) -> Simulated:
    exports = dict(re.findall(r"^export (SIM_[A-Z_]+)=(\S+)$", text, re.MULTILINE))
    block = re.search(r"^providers:\n(?:  .*\n)+sinks:\n(?:  .*\n)+", text, re.MULTILINE)
    base = re.search(r"base_url: (http://\S+)", text)
    assert block and base and set(exports) == {"SIM_API_KEY", "SIM_WEBHOOK_SECRET"}, text
    return Simulated(text, base.group(1), exports, block.group(0))


def _send_test(
    stack: Stack, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_nopoll(
        "send-test", "--config", "nopoll.yaml", *args, cwd=stack.cwd, env=env or stack.env
    )


def _rows(db: Path, where: str, *params: str) -> list[tuple]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2) as conn:
            return conn.execute(
                f"SELECT kind, key, status, output_text FROM nopoll_results WHERE {where} "
                "ORDER BY key",
                params,
            ).fetchall()
    except sqlite3.OperationalError:  # the table is not created yet
        return []


def _wait_rows(db: Path, n: int, where: str, *params: str) -> list[tuple]:
    deadline = time.monotonic() + 40
    rows: list[tuple] = []
    while time.monotonic() < deadline:
        rows = _rows(db, where, *params)
        if len(rows) >= n:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{len(rows)} of {n} rows landed: {rows}")


@dataclass
class Stack:
    cwd: Path
    env: dict[str, str]
    sim: Simulated
    url: str
    serve_out: Path

    @property
    def db(self) -> Path:
        return self.cwd / "nopoll-data" / "results.db"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``nopoll simulate`` (sference dialect, one batch) and ``nopoll serve`` with the
    config block ``simulate`` printed, pasted as it is, in a fresh working directory."""
    cwd = tmp_path_factory.mktemp("try-it")
    started = Started(cwd, _clean_env())
    try:
        args = ("--port", "0", "--dialect", "sference", "--batch", f"b_try:{BATCH_ROWS}")
        proc, out = started.start("simulate", "simulate", *args)
        sim = _parse_simulate(_wait_for_output(out, proc, "Ctrl-C stops the simulator"))
        (cwd / "nopoll.yaml").write_text(sim.config_block)
        started.env = {**started.env, **sim.exports}
        port = free_port()
        _, serve_out = started.start(
            "serve", "serve", "--config", "nopoll.yaml", "--port", str(port)
        )
        try:
            wait_ready(port)
        except AssertionError:
            raise AssertionError(serve_out.read_text(errors="replace")) from None
        yield Stack(cwd, started.env, sim, f"http://127.0.0.1:{port}", serve_out)
    finally:
        started.stop()


def test_simulate_prints_a_paste_ready_config_and_the_next_command(stack):
    config = yaml.safe_load(stack.sim.config_block)
    assert config["providers"]["sim"] == {
        "dialect": "sference",
        "base_url": stack.sim.base_url,
        "api_key": "${SIM_API_KEY}",
        "webhook_secrets": ["${SIM_WEBHOOK_SECRET}"],
    }
    assert stack.sim.exports["SIM_WEBHOOK_SECRET"].startswith("whsec_")
    assert "nopoll send-test --config nopoll.yaml sim\n" in stack.sim.text
    assert "nopoll send-test --config nopoll.yaml sim --batch-id b_try" in stack.sim.text


def test_the_printed_submit_lands_its_row_at_once_though_no_callback_comes(stack):
    """The simulator sends no callbacks of its own, and its config has webhook secrets:
    a ``submit --wait`` of it waited ``reconcile_after_s`` (15 min) for a callback that
    never came (issue 21, "done when"). The submit it prints polls at once (``--poll``)
    and, pasted as it is, lands its row."""
    step = stack.sim.text.split("3. Start nopoll", 1)[1].split("4. Look at the rows", 1)[0]
    commands = [line for line in step.splitlines() if line.startswith(("echo ", "nopoll submit"))]
    assert any(c.startswith("nopoll submit") for c in commands), step
    env = {**stack.env, "PATH": f"{Path(NOPOLL).parent}:{os.environ['PATH']}"}
    began = time.monotonic()
    done = subprocess.run(
        ["bash", "-ec", "\n".join(commands)],
        cwd=stack.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 landed, 0 expired, 0 still pending" in done.stdout, done.stdout
    assert "waiting for callbacks" not in done.stdout
    assert time.monotonic() - began < 30


def test_send_test_is_queued_and_the_row_lands_again_with_a_new_webhook_id(stack):
    result = _send_test(stack, "sim", "--response-id", "resp_try_1", "--url", stack.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "202 queued" in result.stdout
    secret = stack.env["SIM_WEBHOOK_SECRET"]
    assert secret not in result.stdout + result.stderr
    assert secret.removeprefix("whsec_") not in result.stdout + result.stderr
    rows = _wait_rows(stack.db, 1, "key = ?", "resp_try_1")
    # the simulator generated it (nopoll authenticated with the printed api key)
    assert rows == [("response", "resp_try_1", "completed", rows[0][3])] and rows[0][3]

    again = _send_test(stack, "sim", "--response-id", "resp_try_1", "--url", stack.url)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "202 queued" in again.stdout
    ids = re.findall(r"webhook-id (\S+)", result.stdout + again.stdout)
    assert len(set(ids)) == 2  # a fresh webhook-id each time: not a duplicate
    _wait_rows(stack.db, 1, "key = ? AND event_id = ?", "resp_try_1", ids[1])  # refetched
    assert _rows(stack.db, "key = ?", "resp_try_1") == rows  # still one row


def test_send_test_without_an_id_sends_a_random_one_that_lands(stack):
    result = _send_test(stack, "sim", "--url", stack.url)
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"for response (resp_[0-9a-f]{32})", result.stdout)
    assert found, result.stdout
    _wait_rows(stack.db, 1, "key = ?", found.group(1))


def test_send_test_batch_id_lands_every_row_then_the_summary(stack):
    result = _send_test(stack, "sim", "--batch-id", "b_try", "--url", stack.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batch.completed for batch b_try" in result.stdout
    assert "202 queued" in result.stdout
    rows = _wait_rows(stack.db, BATCH_ROWS + 1, "batch_id = ?", "b_try")
    assert len(rows) == BATCH_ROWS + 1
    assert [r[:3] for r in rows if r[0] == "batch"] == [("batch", "b_try", "completed")]
    assert {r[1] for r in rows if r[0] == "batch_row"} == {
        f"b_try/row-{i:06d}" for i in range(BATCH_ROWS)
    }


def test_send_test_with_a_wrong_secret_prints_401_and_why(stack, webhook_secret):
    env = {**stack.env, "SIM_WEBHOOK_SECRET": webhook_secret}  # not the one serve runs with
    result = _send_test(stack, "sim", "--response-id", "resp_try_401", "--url", stack.url, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "401 rejected: no matching signature" in result.stderr
    assert webhook_secret not in result.stdout + result.stderr
    assert _rows(stack.db, "key = ?", "resp_try_401") == []


def test_send_test_to_a_provider_nopoll_does_not_know_prints_404(stack, tmp_path):
    other = tmp_path / "nopoll.yaml"
    other.write_text(stack.sim.config_block.replace("  sim:", "  elsewhere:"))
    result = run_nopoll(
        "send-test", "--config", str(other), "elsewhere", "--url", stack.url, env=stack.env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "404 not found: unknown provider" in result.stderr


def test_send_test_with_nothing_listening_says_connection_refused(tmp_path, webhook_secret):
    (tmp_path / "nopoll.yaml").write_text(
        "providers:\n  sim:\n    dialect: openai\n    base_url: http://127.0.0.1:9/v1\n"
        "    webhook_secrets: ['${SIM_WEBHOOK_SECRET}']\n"
    )
    url = f"http://127.0.0.1:{free_port()}"
    env = {**_clean_env(), "SIM_WEBHOOK_SECRET": webhook_secret}
    result = run_nopoll(
        "send-test", "--config", "nopoll.yaml", "sim", "--url", url, cwd=tmp_path, env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"connection refused: is nopoll running at {url}?" in result.stderr
    assert webhook_secret not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("provider", "config", "message"),
    [
        ("nope", "providers: {}\n", "provider 'nope' is not in nopoll.yaml (configured: none)"),
        (
            "sim",
            "providers:\n  sim:\n    dialect: openai\n    base_url: http://127.0.0.1:9/v1\n"
            "    webhook_secrets: ['${SIM_WEBHOOK_SECRET}']\n",
            "environment variable SIM_WEBHOOK_SECRET is not set",
        ),
    ],
)
def test_send_test_config_problems_exit_2(tmp_path, provider, config, message):
    (tmp_path / "nopoll.yaml").write_text(config)
    result = run_nopoll(
        "send-test", "--config", "nopoll.yaml", provider, cwd=tmp_path, env=_clean_env()
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


def test_simulate_answers_any_response_id_with_its_key_and_stops_on_sigterm(tmp_path):
    started = Started(tmp_path, _clean_env())
    try:
        proc, out = started.start("simulate", "simulate", "--port", "0")
        sim = _parse_simulate(_wait_for_output(out, proc, "Ctrl-C stops the simulator"))
        auth = {"authorization": f"Bearer {sim.exports['SIM_API_KEY']}"}
        with httpx.Client(timeout=5, trust_env=False) as client:
            first = client.get(f"{sim.base_url}/responses/resp_anything", headers=auth)
            second = client.get(f"{sim.base_url}/responses/resp_anything", headers=auth)
            no_key = client.get(f"{sim.base_url}/responses/resp_anything")
            not_a_response = client.get(f"{sim.base_url}/responses/other_id", headers=auth)
        assert first.status_code == 200 and first.json()["status"] == "completed"
        assert first.json() == second.json()  # generated from the id: the same every time
        assert no_key.status_code == 401
        assert not_a_response.status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert "simulator stopped" in out.read_text()
    finally:
        started.stop()


def test_simulate_refuses_a_bad_batch_spec(tmp_path):
    result = run_nopoll(
        "simulate", "--port", "0", "--batch", "no-rows", cwd=tmp_path, env=_clean_env()
    )
    assert result.returncode == 2
    assert "expected ID:ROWS" in result.stderr


def test_send_test_needs_only_its_own_providers_variables(stack):
    """Another provider's unset key (or a sink's unset URL) is no reason to refuse: send-test
    uses only the provider it signs for."""
    config = stack.cwd / "two-providers.yaml"
    other = (
        "  other:\n    dialect: openai\n    base_url: http://127.0.0.1:9/v1\n"
        "    api_key: ${OTHER_API_KEY_NOT_SET}\n"
        "    webhook_secrets: ['${OTHER_SECRET_NOT_SET}']\n"
    )
    config.write_text(
        stack.sim.config_block.replace("sinks:\n", other + "sinks:\n")
        + "  audit: {type: http, url: '${AUDIT_URL_NOT_SET}', secret: '${AUDIT_SECRET_NOT_SET}'}\n"
    )
    result = run_nopoll(
        "send-test",
        "--config",
        str(config),
        "sim",
        "--url",
        stack.url,
        cwd=stack.cwd,
        env=stack.env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "202 queued" in result.stdout
    # and for the provider it signs for, an unset variable still refuses (exit 2)
    refused = run_nopoll(
        "send-test",
        "--config",
        str(config),
        "other",
        "--url",
        stack.url,
        cwd=stack.cwd,
        env=stack.env,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "environment variable OTHER_SECRET_NOT_SET is not set" in refused.stderr


@pytest.mark.parametrize("dialect", ["sail", "anthropic"])
def test_simulate_without_webhooks_prints_no_secret_and_its_printed_commands_land_rows(
    tmp_path, dialect
):
    """Sail and Anthropic send no webhooks: no secret, no send-test; what it prints instead
    (a submit that nopoll polls: single responses for Sail, a Message Batch for Anthropic,
    and a watch of the batch it serves) lands its rows when pasted as it is. ``--name``
    keeps its variables apart from another simulator's."""
    name, batch_rows = f"{dialect}1", 3
    started = Started(tmp_path, _clean_env())
    try:
        proc, out = started.start(
            "simulate",
            "simulate",
            "--port",
            "0",
            "--dialect",
            dialect,
            "--name",
            name,
            "--batch",
            f"b_try:{batch_rows}",
        )
        text = _wait_for_output(out, proc, "Ctrl-C stops the simulator")
        assert "WEBHOOK_SECRET" not in text and "webhook_secrets" not in text, text
        assert "nopoll send-test" not in text and "whsec_" not in text
        assert f"{dialect} sends no webhooks" in text
        exports = dict(re.findall(r"^export ([A-Z0-9_]+)=(\S+)$", text, re.MULTILINE))
        assert set(exports) == {f"{name.upper()}_API_KEY"}, text
        block = re.search(r"^providers:\n(?:  .*\n)+sinks:\n(?:  .*\n)+", text, re.MULTILINE)
        assert block, text
        config = yaml.safe_load(block.group(0))
        assert config["providers"][name]["dialect"] == dialect
        assert "webhook_secrets" not in config["providers"][name]
        # Anthropic's base_url is the API host, as in its SDK; the others' end in /v1
        assert config["providers"][name]["base_url"].endswith("/v1") is (dialect != "anthropic")
        (tmp_path / "nopoll.yaml").write_text(block.group(0))
        started.env = {**started.env, **exports}
        port = free_port()
        _, serve_out = started.start(
            "serve", "serve", "--config", "nopoll.yaml", "--port", str(port)
        )
        try:
            wait_ready(port)
        except AssertionError:
            raise AssertionError(serve_out.read_text(errors="replace")) from None
        step = text.split("3. Start nopoll", 1)[1].split("4. Look at the rows", 1)[0]
        commands = [
            line
            for line in step.splitlines()
            if line.startswith(("echo ", "nopoll ")) and "serve" not in line
        ]
        assert any(c.startswith("nopoll submit") for c in commands), step
        env = {**started.env, "PATH": f"{Path(NOPOLL).parent}:{os.environ['PATH']}"}
        done = subprocess.run(
            ["bash", "-ec", "\n".join(commands)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 landed" in done.stdout, done.stdout
        db = tmp_path / "nopoll-data" / "results.db"
        if dialect == "anthropic":  # a Message Batch of the one line, then the served batch
            submitted = _wait_rows(db, 1, "kind = 'batch_row' AND key NOT LIKE 'b_try/%'")
            assert [row[2] for row in submitted] == ["completed"], submitted
            assert submitted[0][1].startswith("msgbatch_") and submitted[0][3]
        else:
            rows = _wait_rows(db, 1, "kind = 'response'")
            assert rows[0][2] == "completed"
        served = _wait_rows(db, batch_rows, "kind = 'batch_row' AND key LIKE 'b_try/%'")
        assert {row[2] for row in served} == {"completed"}
    finally:
        started.stop()


@pytest.mark.parametrize(
    ("flag", "per_min"), [((), 60), (("--rate-limit", "5"), 5), (("--rate-limit", "0"), None)]
)
def test_simulate_valar_limits_each_key_as_valar_documents(tmp_path, flag, per_min):
    """``nopoll simulate --dialect valar`` limits requests as Valar's limits page says (60 a
    minute per key, ``X-RateLimit-*`` headers); ``--rate-limit`` changes it, 0 turns it off."""
    started = Started(tmp_path, _clean_env())
    try:
        args = ("simulate", "--port", "0", "--dialect", "valar", *flag)
        proc, out = started.start("simulate", *args)
        text = _wait_for_output(out, proc, "Ctrl-C stops the simulator")
        key = re.search(r"^export SIM_API_KEY=(\S+)$", text, re.MULTILINE)
        base = re.search(r"base_url: (http://\S+)", text)
        assert key and base, text
        assert (f"may send {per_min} requests a minute" in text) is (per_min is not None)
        answer = httpx.get(
            f"{base.group(1)}/batches",
            headers={"authorization": f"Bearer {key.group(1)}"},
            timeout=10,
            trust_env=False,
        )
        assert answer.status_code == 200 and answer.json() == []
        limit = answer.headers.get("x-ratelimit-limit")
        assert limit == (str(per_min) if per_min else None)
    finally:
        started.stop()
