"""Fixtures of the chaos proof: a provider target (parametrized; the Kubernetes one plugs
in here) and a breakable installation with its own Redis and PostgreSQL."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.chaos.targets import ChaosTarget, LocalTarget
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


@pytest.fixture
def chaos_root() -> Iterator[Path]:
    """Outside pytest's private tmp dir: the postgres user must reach its data dir."""
    root = Path(tempfile.mkdtemp(prefix="leasekeeper-chaos-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["local"])
def target(request: pytest.FixtureRequest, chaos_root: Path) -> ChaosTarget:
    if request.param == "local":
        return LocalTarget(root=chaos_root / "sandboxes", faults_file=chaos_root / "faults.json")
    raise AssertionError(f"no chaos target {request.param!r}")


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
