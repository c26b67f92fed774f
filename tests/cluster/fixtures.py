"""Owns the pytest fixtures of the Kubernetes test cluster harness (import them into a
conftest.py). Session scope: ``kube_cluster`` (a real API server: started here, or the cluster
of ``LEASEKEEPER_TEST_KUBECONFIG``), ``kube_api``, ``kubelet_sim``, ``sandbox_controller``.
Function scope: ``fault_proxy``, ``k8s_namespace``.

Environment:
- ``LEASEKEEPER_TEST_KUBECONFIG``: use that cluster as it is (nothing is started for it).
- ``LEASEKEEPER_TEST_REAL_KUBELETS=1``: that cluster runs pods itself, so no kubelet simulator.
- ``LEASEKEEPER_TEST_REAL_SANDBOX_CONTROLLER=1``: it runs agent-sandbox, so no Sandbox simulator.
- ``LEASEKEEPER_TEST_AUTHZ``: ``RBAC`` (default) or ``AlwaysAllow`` for the started cluster.
- ``LEASEKEEPER_KUBE_BIN_DIR``: use these binaries instead of build.sh's cache.
Missing binaries that cannot be built fail the test with the build's error, never skip it.
A conftest.py should call ``prebuild_binaries(session)`` from ``pytest_collection_finish`` so a
cold build (~6 minutes) does not run inside the first test's timeout.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from kubernetes import client

from tests.cluster.binaries import BinariesUnavailable, locate_binaries
from tests.cluster.cluster import AuthorizationMode, ClusterAccess, ExternalCluster, KubeCluster
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.kubelet_sim import KubeletSim
from tests.cluster.sandbox_controller import SandboxController, install_sandbox_crd

ENV_KUBECONFIG = "LEASEKEEPER_TEST_KUBECONFIG"
ENV_REAL_KUBELETS = "LEASEKEEPER_TEST_REAL_KUBELETS"
ENV_REAL_SANDBOX = "LEASEKEEPER_TEST_REAL_SANDBOX_CONTROLLER"
ENV_AUTHZ = "LEASEKEEPER_TEST_AUTHZ"
STATIC_USERS = {"alice": [], "bob": ["leasekeeper-testers"]}


_prebuild: dict[str, object] = {}


def prebuild_binaries(session: pytest.Session) -> None:
    """Build or locate the binaries before any test runs, outside the per-test timeouts (a
    cold build takes ~6 minutes). Call it from ``pytest_collection_finish`` in a conftest.py;
    it does nothing unless a collected test is marked ``k8s`` and no external cluster is set."""
    if os.environ.get(ENV_KUBECONFIG) or "bin_dir" in _prebuild:
        return
    if not any(item.get_closest_marker("k8s") for item in session.items):
        return
    try:
        _prebuild["bin_dir"] = locate_binaries()
    except BinariesUnavailable as exc:
        _prebuild["error"] = exc


def _binaries() -> Path:
    if "error" in _prebuild:
        raise cast(BinariesUnavailable, _prebuild["error"])
    if "bin_dir" in _prebuild:
        return cast(Path, _prebuild["bin_dir"])
    return locate_binaries()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterAccess]:
    """The test cluster. A started one is a ``KubeCluster`` (RBAC by default, static users
    ``alice`` and ``bob`` via ``token_for``); ``LEASEKEEPER_TEST_KUBECONFIG`` gives an
    ``ExternalCluster``. Both offer ``kubeconfig_path``, ``api_url``, ``admin_token``,
    ``ca_file``, ``api_client()``, ``kubeconfig_for_token()``, ``service_account_token()``."""
    external = os.environ.get(ENV_KUBECONFIG)
    if external:
        cluster: ClusterAccess = ExternalCluster(external, tmp_path_factory.mktemp("external"))
        yield cluster
        return
    try:
        bin_dir = _binaries()
    except BinariesUnavailable as exc:
        pytest.fail(f"Kubernetes test binaries unavailable: {exc}", pytrace=False)
    mode = cast(AuthorizationMode, os.environ.get(ENV_AUTHZ, "RBAC"))
    started = KubeCluster(bin_dir, authorization_mode=mode, static_users=STATIC_USERS,
                          before_controllers=install_sandbox_crd)
    with started:
        yield started


@pytest.fixture(scope="session")
def kube_api(kube_cluster: ClusterAccess) -> Iterator[client.ApiClient]:
    """An admin ``ApiClient`` for the session (do not close it)."""
    with kube_cluster.api_client() as api:
        yield api


@pytest.fixture(scope="session")
def kubelet_sim(kube_cluster: ClusterAccess, kube_api: client.ApiClient,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeletSim | None]:
    """The kubelet simulator (Node ``sim-node``), or None when the cluster has real kubelets."""
    if os.environ.get(ENV_KUBECONFIG) and _flag(ENV_REAL_KUBELETS):
        yield None
        return
    with KubeletSim(kube_api, workdir=tmp_path_factory.mktemp("kubelet")) as sim:
        yield sim


@pytest.fixture(scope="session")
def sandbox_controller(kube_api: client.ApiClient,
                       kubelet_sim: KubeletSim | None) -> Iterator[SandboxController | None]:
    """The Sandbox CRD installed plus the controller simulator (None with a real one)."""
    install_sandbox_crd(kube_api)
    if os.environ.get(ENV_KUBECONFIG) and _flag(ENV_REAL_SANDBOX):
        yield None
        return
    with SandboxController(kube_api) as controller:
        yield controller


def new_fault_proxy(cluster: ClusterAccess, workdir: Path) -> FaultProxy:
    """A fault proxy (not started) in front of ``cluster``'s API server."""
    ca = cluster.ca if isinstance(cluster, KubeCluster) else None
    return FaultProxy(cluster.api_url, upstream_ca=cluster.ca_file, token=cluster.admin_token,
                      ca=ca, workdir=workdir)


def create_namespace(api: client.ApiClient) -> str:
    """A fresh namespace ``lk-<random>``."""
    name = f"lk-{secrets.token_hex(4)}"
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def delete_namespace(api: client.ApiClient, name: str) -> None:
    """Delete a namespace without waiting (404 is fine)."""
    try:
        client.CoreV1Api(api).delete_namespace(name, propagation_policy="Background")
    except client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def fault_proxy(kube_cluster: ClusterAccess,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultProxy]:
    """A fresh fault proxy in front of the API server; ``kubeconfig_path`` uses the admin
    token through the proxy; ``kubeconfig_for_token(token)`` for other identities."""
    with new_fault_proxy(kube_cluster, tmp_path_factory.mktemp("proxy")) as proxy:
        yield proxy


@pytest.fixture
def k8s_namespace(kube_api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace (``lk-<random>``), deleted after the test (without waiting)."""
    name = create_namespace(kube_api)
    yield name
    delete_namespace(kube_api, name)
