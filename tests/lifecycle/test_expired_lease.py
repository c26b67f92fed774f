"""A lease past its absolute deadline (``ttl_s``) is expired: sweep.expire_leases ends it at
its next tick, and meanwhile nothing may hand it to a run. A resume check answers "not
resumable: expired" (and ends it as the sweep would), a touch moves nothing, and a reuse
acquires fresh. On SQLite and PostgreSQL, over real local sandboxes.

Before: a resume check 2 s past a 2 s ttl answered ``resumable`` and a touch moved the idle
deadline past the absolute one; the web backend went on, and lost the sandbox at the
sweep's next tick."""

from __future__ import annotations

from datetime import timedelta

import pytest

from models.schema import LeaseState, utcnow
from providers.base import ResumeOutcome
from providers.spec import SandboxSpec
from tasks.acquire import AcquireResult, acquire_lease
from tasks.destroy import destroy_lease
from tasks.resume import check_lease
from tasks.runs import touch
from tests.sweeps.conftest import set_lease
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(120)


def expire(rt: Runtime, lease_id: str) -> None:
    set_lease(rt, lease_id, deadline_at=utcnow() - timedelta(seconds=2))


def test_a_resume_check_past_the_deadline_is_not_resumable_and_ends_the_lease(
    rt: Runtime,
) -> None:
    lease_id = acquire_lease(rt, "run-1", SandboxSpec(), None, False).lease_id
    expire(rt, lease_id)
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.NOT_RESUMABLE
    assert checked.reason.startswith("expired: past its absolute deadline (")
    assert checked.destroy_enqueued and checked.destroy_reason == "expired"
    lease = rt.store.get_lease(lease_id)
    assert (lease.state, lease.end_reason) == (LeaseState.PENDING_CLEANUP, "expired")
    assert destroy_lease(rt, lease_id, checked.destroy_reason, None).state == "destroyed"
    assert rt.provider("local").list_managed() == []


def test_a_resume_check_before_the_deadline_is_still_activity(rt: Runtime) -> None:
    lease_id = acquire_lease(rt, "run-1", SandboxSpec(), None, False).lease_id
    set_lease(rt, lease_id, deadline_at=utcnow() + timedelta(minutes=5),
              idle_deadline_at=utcnow() - timedelta(seconds=1))  # idle: activity saves it
    assert check_lease(rt, lease_id, None).outcome == ResumeOutcome.RESUMABLE
    assert rt.store.get_lease(lease_id).idle_deadline_at > utcnow()


def test_a_touch_past_the_deadline_moves_nothing(rt: Runtime) -> None:
    lease_id = acquire_lease(rt, "run-1", SandboxSpec(), None, False).lease_id
    expire(rt, lease_id)
    before = rt.store.get_lease(lease_id)
    assert rt.store.touch(lease_id) is None
    # lease.touch's answer says why (a QA pass: it looked the same as a destroyed lease's)
    assert touch(rt, lease_id) == {
        "lease_id": lease_id, "touched": False, "idle_deadline_at": None,
        "reason": "expired: past its absolute deadline; activity does not save it"}
    after = rt.store.get_lease(lease_id)
    assert (after.state, after.idle_deadline_at) == (LeaseState.ACTIVE,
                                                     before.idle_deadline_at)


def test_a_reuse_of_an_expired_sandbox_acquires_fresh(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th", reuse=True)
    old = acquire_lease(rt, "run-1", spec, None, False).lease_id
    expire(rt, old)
    fresh = acquire_lease(rt, "run-2", spec, None, False)
    assert fresh.result == AcquireResult.ACQUIRED and fresh.lease_id != old
    ended = rt.store.get_lease(old)
    assert (ended.state, ended.end_reason) == (LeaseState.DESTROYED, "expired")
    assert rt.store.get_run("run-2").lease_id == fresh.lease_id  # type: ignore[union-attr]
