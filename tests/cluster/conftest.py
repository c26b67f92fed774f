"""Owns the pytest wiring of tests/cluster: makes the harness fixtures available here and
builds or locates the Kubernetes binaries before the tests run (outside test timeouts)."""

import pytest

from tests.cluster.fixtures import (  # noqa: F401
    fault_proxy,
    k8s_namespace,
    kube_api,
    kube_cluster,
    kubelet_sim,
    prebuild_binaries,
    sandbox_controller,
)


def pytest_collection_finish(session: pytest.Session) -> None:
    prebuild_binaries(session)
