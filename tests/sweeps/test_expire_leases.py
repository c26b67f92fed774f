"""sweep.expire_leases: active leases at or past their absolute or idle deadline are
destroyed; activity (lease.touch, a resumable resume check) moves only the idle deadline."""

from __future__ import annotations

from datetime import timedelta

import pytest

from models.schema import LeaseState, utcnow
from models.sweep_store import SweepStore
from tasks.resume import check_lease
from tasks.sweeping import SweepContext
from tasks.sweeps import ExpireOutcome, expire_leases
from tests.sweeps.conftest import Recorder, acquire, concurrently, events_to, set_lease
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def test_deadlines_are_inclusive_and_say_which_passed(rt: Runtime) -> None:
    now = utcnow().replace(microsecond=0)
    later = now + timedelta(hours=1)
    idle, expired, fresh = (acquire(rt, f"run-{i}") for i in range(3))
    set_lease(rt, idle, idle_deadline_at=now, deadline_at=later)
    set_lease(rt, expired, idle_deadline_at=later, deadline_at=now)
    set_lease(rt, fresh, idle_deadline_at=now + timedelta(microseconds=1), deadline_at=later)
    due = SweepStore(rt.store).due_expiries(now, 10)
    assert {(d.lease_id, d.kind) for d in due} == {(idle, "idle"), (expired, "expired")}


def test_expired_lease_is_marked_and_destroyed_once(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1")
    set_lease(rt, lease_id, idle_deadline_at=utcnow())
    effects.inline = True
    tally = expire_leases(SweepContext(rt, effects))
    assert tally[ExpireOutcome.IDLE] == 1 and effects.destroys == [(lease_id, "idle")]
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "idle"
    assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "idle: past its idle timeout") == 1
    assert rt.provider("local").list_managed() == []
    assert sum(expire_leases(SweepContext(rt, effects)).counts.values()) == 0


def test_touch_before_the_claim_saves_the_lease(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    set_lease(rt, lease_id, idle_deadline_at=utcnow())
    claims = SweepStore(rt.store)
    now = utcnow()
    decided = [d.lease_id for d in claims.due_expiries(now, 10)]
    assert decided == [lease_id]
    rt.store.touch(lease_id)  # activity between decide and claim
    assert claims.claim_expiries(decided, now, 5, None) == []
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE


def test_activity_moves_the_idle_deadline_but_never_the_absolute_one(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    absolute = rt.store.get_lease(lease_id).deadline_at
    set_lease(rt, lease_id, idle_deadline_at=utcnow() - timedelta(seconds=1))
    rt.store.touch(lease_id)  # lease.touch / producer.touch_lease
    touched = rt.store.get_lease(lease_id)
    assert touched.idle_deadline_at > utcnow() and touched.deadline_at == absolute
    set_lease(rt, lease_id, idle_deadline_at=utcnow() - timedelta(seconds=1))
    check_lease(rt, lease_id, None)  # a resumable resume check counts as activity too
    checked = rt.store.get_lease(lease_id)
    assert checked.idle_deadline_at > utcnow() and checked.deadline_at == absolute
    set_lease(rt, lease_id, deadline_at=utcnow())  # touching never saves it from this one
    rt.store.touch(lease_id)
    assert [d.kind for d in SweepStore(rt.store).due_expiries(utcnow(), 10)] == ["expired"]


def test_overlapping_ticks_expire_each_lease_once(rt: Runtime, effects: Recorder) -> None:
    leases = [acquire(rt, f"run-{i}") for i in range(6)]
    for lease_id in leases:
        set_lease(rt, lease_id, idle_deadline_at=utcnow())
    tallies = concurrently([lambda: expire_leases(SweepContext(rt, effects))] * 3)
    assert sum(t[ExpireOutcome.IDLE] for t in tallies) == 6
    assert sorted(lid for lid, _ in effects.destroys) == sorted(leases)
    for lease_id in leases:
        assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "idle") == 1


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1")
    set_lease(rt, lease_id, deadline_at=utcnow())
    tally = expire_leases(SweepContext(rt, effects, dry_run=True))
    assert tally[ExpireOutcome.EXPIRED] == 1 and f"expired {lease_id}" in tally.items
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE and effects.destroys == []
