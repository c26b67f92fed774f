"""deploy/'s tests use the Kubernetes test cluster (tests/cluster)."""

from __future__ import annotations

import pytest

from tests.cluster.fixtures import kube_api, kube_cluster, kubelet_sim  # noqa: F401
from tests.cluster.fixtures import prebuild_binaries as _prebuild_binaries


def pytest_collection_finish(session: pytest.Session) -> None:
    _prebuild_binaries(session)  # a cold build must not run inside the first test's timeout
