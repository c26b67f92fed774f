"""Races a web backend makes through the broker, with a real Celery worker (prefork, two
processes) and a provider slowed at its seam, on SQLite and PostgreSQL: the same run's
acquire sent twice at once, and a ``run.finish`` sent right behind its acquire. Afterwards
the run and lease records tell the truth and no sandbox is lost or left behind."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from models.invariants import check
from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.base import ResumeOutcome
from tasks import producer
from tasks.leases import handle
from tests.e2e.conftest import eventually
from tests.pools.conftest import warm
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def rid(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def truthful(rt: Runtime, *ids: str) -> None:
    found = [v.describe() for v in check(rt.store, utcnow(), rt.settings.claim_timeout_s)
             if v.run_id in ids or v.lease_id in ids]
    assert found == []


def reclaimed(rt: Runtime, run_id: str) -> Any:
    return eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                      60, f"the reclaim of {run_id}")


def test_the_same_acquire_sent_twice_at_once_keeps_the_sandbox(stack: WorkerStack) -> None:
    # Before: the copy whose provider call was slower found the lease active (the other
    # copy had adopted its sandbox and activated it), took that for "ended meanwhile" and
    # destroyed the run's sandbox.
    rt, run_id = stack.runtime(), rid()
    stack.faults.write({"acquire": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    spec = {"provider": "faulty"}
    copies = [producer.acquire_lease(run_id, spec), producer.acquire_lease(run_id, spec)]
    answers = [c.get(60) for c in copies]
    assert sorted(a["result"] for a in answers)[0] in {"acquired", "adopted"}
    assert sorted(a["result"] for a in answers)[1] == "already_acquired"
    lease_id = answers[0]["lease_id"]
    assert answers[1]["lease_id"] == lease_id
    lease, run = rt.store.get_lease(lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id) == (RunStatus.RUNNING, lease_id)
    assert rt.provider("faulty").resume_check(handle(lease), 5).outcome == \
        ResumeOutcome.RESUMABLE
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease_id)


@pytest.fixture(scope="module")
def pool_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[WorkerStack]:
    """A worker on a queue and SQLite store of its own, with a one-member pool of the
    faulty provider (so its claims can be slowed)."""
    from tests.pools.conftest import WAITING_MEMBER, destroy_everything

    pools = [{"name": "slowclaim", "provider": "faulty", "size": 1,
              "template": {"command": WAITING_MEMBER}}]
    with own_queue_stack("races", redis_server.url, tmp_path_factory.mktemp("races"),
                         {"LEASEKEEPER_POOLS": json.dumps(pools)}) as stack:
        try:
            yield stack
        finally:
            stack.stop()
            destroy_everything(stack.runtime())


def test_the_same_pool_claim_sent_twice_at_once_answers_already_acquired(
        pool_stack: WorkerStack) -> None:
    # Before: the copy whose claim was slower found the member active for its own run and
    # failed with "was ended (active) while it was being claimed".
    rt, run_id = pool_stack.runtime(), rid()
    pool_stack.faults.write({})
    app.send_task("sweep.fill_pools").get(60)
    member = eventually(lambda: next(iter(warm(rt, "slowclaim")), None), 60, "a warm member")
    pool_stack.faults.write({"claim": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    spec = {"pool": "slowclaim"}
    copies = [producer.acquire_lease(run_id, spec), producer.acquire_lease(run_id, spec)]
    answers = sorted((c.get(60) for c in copies), key=lambda a: str(a["result"]))
    assert [a["result"] for a in answers] == ["already_acquired", "claimed"]
    assert {a["lease_id"] for a in answers} == {member.lease_id}
    lease, run = rt.store.get_lease(member.lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id) == (RunStatus.RUNNING, member.lease_id)
    assert rt.provider("faulty").resume_check(handle(lease), 5).outcome == \
        ResumeOutcome.RESUMABLE
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, member.lease_id)
