"""Fixtures of the chaos proof: a provider target (parametrized: ``local``, and
``kubernetes`` on the real API server of tests/cluster, marked ``k8s`` so the binaries are
built or located before any test runs) and a breakable installation with its own Redis and
PostgreSQL.

Runs per target: ``LEASEKEEPER_CHAOS_RUNS`` (local, 240) and ``LEASEKEEPER_CHAOS_KUBE_RUNS``
(kubernetes, 96: every run there is a workload, a Secret and a pod on one API server, and
the proof has to stay a few minutes long on a loaded two-CPU CI machine).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kubernetes import client

from tests.chaos.kube_target import KubeTarget
from tests.chaos.targets import ChaosTarget, LocalTarget
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.fixtures import *  # noqa: F403 - the cluster harness's fixtures
from tests.cluster.fixtures import prebuild_binaries
from tests.services import free_port, start_postgres, start_redis

if TYPE_CHECKING:
    from tests.chaos.cluster import ChaosCluster

# Short lifetimes, claims and backoffs, so everything the attack leaves behind is due for
# a sweep within seconds; beat runs every sweep every second.
CHAOS_SETTINGS: dict[str, str] = {
    "LEASEKEEPER_TASK_MAX_RETRIES": "3",
    "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "0.2",
    "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "1",
    "LEASEKEEPER_TASK_SOFT_TIME_LIMIT_S": "40",
    "LEASEKEEPER_TASK_TIME_LIMIT_S": "50",
    "LEASEKEEPER_CLEANUP_BACKOFF_S": "0.5",
    "LEASEKEEPER_CLEANUP_MAX_ATTEMPTS": "2",
    "LEASEKEEPER_CLAIM_TIMEOUT_S": "4",
    "LEASEKEEPER_LOCAL_DESTROY_GRACE_S": "1",
    "LEASEKEEPER_RUN_DETACH_TTL_S": "2",
    "LEASEKEEPER_ACQUIRE_TIMEOUT_S": "8",
    "LEASEKEEPER_RESUME_TIMEOUT_S": "3",
    "LEASEKEEPER_LEASE_IDLE_TIMEOUT_S": "10",
    "LEASEKEEPER_LEASE_TTL_S": "60",
    "LEASEKEEPER_ORPHAN_GRACE_S": "5",
    "LEASEKEEPER_SWEEP_LOCK_TTL_S": "10",
    "LEASEKEEPER_SWEEP_BATCH_SIZE": "50",
    "LEASEKEEPER_ORPHAN_BATCH_SIZE": "50",
}


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture
def chaos_root(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Outside pytest's private tmp dir: the postgres user must reach its data dir. Kept
    when the test fails (workers.log, the beats' logs, the store's data directory)."""
    root = Path(tempfile.mkdtemp(prefix="leasekeeper-chaos-"))
    root.chmod(0o755)
    yield root
    if request.node.stash.get(FAILED, False):
        print(f"\nchaos proof failed: its logs and store are kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    prebuild_binaries(session)  # a cold build must not run inside the proof's timeout


@pytest.fixture(params=["local", pytest.param("kubernetes", marks=pytest.mark.k8s)])
def target(request: pytest.FixtureRequest, chaos_root: Path) -> ChaosTarget:
    if request.param == "local":
        return LocalTarget(root=chaos_root / "sandboxes", faults_file=chaos_root / "faults.json",
                           runs=int(os.environ.get("LEASEKEEPER_CHAOS_RUNS", "240")))
    if request.param == "kubernetes":
        found: KubeTarget = request.getfixturevalue("kube_target")
        return found
    raise AssertionError(f"no chaos target {request.param!r}")


@pytest.fixture
def kube_target(kube_api: client.ApiClient, kubelet_sim: object, sandbox_controller: object,
                fault_proxy: FaultProxy, k8s_namespace: str) -> KubeTarget:
    """Workers reach the API server through ``fault_proxy``, in a namespace of their own;
    pods run on the kubelet simulator, Sandboxes are reconciled by the controller simulator
    (or the real ones of an external cluster)."""
    return KubeTarget(proxy=fault_proxy, admin=kube_api, namespace=k8s_namespace,
                      runs=int(os.environ.get("LEASEKEEPER_CHAOS_KUBE_RUNS", "96")))


@pytest.fixture
def chaos(target: ChaosTarget, chaos_root: Path) -> Iterator[ChaosCluster]:
    from models.migrate import upgrade
    from tests.chaos.cluster import ChaosCluster  # not at load time:
    # they import the Celery app, whose broker is set only in pytest_configure

    root = chaos_root
    redis = start_redis(root / "redis", free_port())
    postgres = start_postgres(root / "postgres")
    cluster = ChaosCluster(
        root=root, redis=redis, postgres=postgres,
        store_url=postgres.create_database(f"chaos_{uuid.uuid4().hex[:8]}"),
        env_overrides={**CHAOS_SETTINGS, **target.env})
    upgrade(cluster.store_url)
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.redis.stop()
        cluster.postgres.stop()
