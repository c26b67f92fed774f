"""Scale-out: workers on different lanes (as on different hosts) share one PostgreSQL store
and one Redis. Each serves only its lanes, the lifecycle completes across them, and the
store ends with every record true (bench/scaleout.py measures how throughput grows)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from models.invariants import check
from models.migrate import upgrade
from models.schema import LeaseState, RunStatus, utcnow
from tasks import producer
from tests.services import PostgresServer, RedisServer
from tests.stack import WorkerStack, sending_to
from workers.app import app
from workers.queues import Lane, queue_name

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]
PAIRS = 20


def served(stack: WorkerStack, proc: object) -> dict[str, int]:
    """Tasks the worker ``proc`` has run so far, by name (its own `inspect stats`)."""
    hostname = stack.hostname(stack.procs.index(proc) + 1)  # type: ignore[arg-type]
    stats = app.control.inspect(destination=[hostname], timeout=5).stats()
    assert stats and hostname in stats, f"{hostname} did not answer"
    return dict(stats[hostname].get("total", {}))


def test_workers_on_separate_lanes_share_one_postgres_and_one_redis(
        redis_server: RedisServer, postgres_server: PostgresServer, tmp_path: Path) -> None:
    # given one store and one broker, and two workers: one on the acquire lane (two pool
    # processes), one on the cleanup lane
    url = postgres_server.create_database(f"lk_scale_{uuid.uuid4().hex[:8]}")
    upgrade(url)
    queue = f"scale-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=url, root=tmp_path, broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    rt = stack.runtime()
    with sending_to(queue):
        try:
            acquirer = stack.start_worker(concurrency=2,
                                          queues=[queue_name(queue, Lane.ACQUIRE)])
            cleaner = stack.start_worker(concurrency=1,
                                         queues=[queue_name(queue, Lane.CLEANUP)])
            # when runs acquire at once, then destroy at once
            runs = [f"{queue}-{i}" for i in range(PAIRS)]
            sent = [producer.acquire_lease(run, {"provider": "noop"}) for run in runs]
            leases = [r.get(120)["lease_id"] for r in sent]
            done = [producer.destroy_lease(lease_id) for lease_id in leases]
            assert {r.get(120)["state"] for r in done} == {"destroyed"}
            # then each worker ran its lane's tasks and nothing else
            assert served(stack, acquirer) == {"lease.acquire": PAIRS}
            assert served(stack, cleaner) == {"lease.destroy": PAIRS}
            # and the shared store tells the truth: every lease destroyed once, its run
            # settled with it, every change an event, no invariant broken
            for run_id, lease_id in zip(runs, leases, strict=True):
                lease, run = rt.store.get_lease(lease_id), rt.store.get_run(run_id)
                assert lease.state == LeaseState.DESTROYED and lease.run_id == run_id
                assert run is not None and run.status == RunStatus.ABORTED
                assert [e.to_state for e in rt.store.events(lease_id)] == [
                    "provisioning", "active", "destroying", "destroyed"]
            assert check(rt.store, utcnow(), rt.settings.claim_timeout_s, None,
                         rt.settings.leaseless_run_grace_s) == []
            # and with the cleanup worker gone a destroy waits for a cleanup worker: the
            # acquire worker never takes it
            stack.kill_worker(cleaner)
            lease_id = producer.acquire_lease(f"{queue}-late", {"provider": "noop"}).get(
                120)["lease_id"]
            waiting = producer.destroy_lease(lease_id)
            with pytest.raises(CeleryTimeout):
                waiting.get(3)
            assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE
            stack.start_worker(concurrency=1, queues=[queue_name(queue, Lane.CLEANUP)])
            assert waiting.get(120)["state"] == "destroyed"
        finally:
            stack.stop()
            rt.store.dispose()
