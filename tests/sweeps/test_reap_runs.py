"""sweep.reap_runs: detached runs past the TTL (inclusive) are aborted and reclaimed; a
viewer that came back before the claim keeps its run; lost reclaims are re-sent once."""

from __future__ import annotations

from datetime import timedelta

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from models.sweep_store import SweepStore
from tasks.runs import finish
from tasks.sweeping import SweepContext
from tasks.sweeps import ReapOutcome, reap_runs
from tests.sweeps.conftest import Recorder, acquire, concurrently, events_to, set_run
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def test_cutoff_is_inclusive(rt: Runtime) -> None:
    acquire(rt, "run-at")
    acquire(rt, "run-after")
    cutoff = utcnow().replace(microsecond=0)
    set_run(rt, "run-at", detached_since=cutoff)
    set_run(rt, "run-after", detached_since=cutoff + timedelta(microseconds=1))
    claims = SweepStore(rt.store)
    assert claims.due_detached_runs(cutoff, 10) == ["run-at"]
    assert claims.claim_detached_runs(["run-at", "run-after"], cutoff, 5) == [("run-at", True)]
    assert rt.store.get_run("run-after").status == RunStatus.RUNNING


def test_detached_run_is_aborted_with_cancel_intent_and_reclaimed(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-1")
    rt.store.set_detached("run-1", detached=True)
    effects.inline = True
    tally = reap_runs(SweepContext(rt, effects))
    assert tally[ReapOutcome.ABORTED_DETACHED] == 1 and tally[ReapOutcome.RECLAIMS_ENQUEUED] == 1
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.ABORTED and run.cancel_requested
    assert run.error == "detached past its TTL" and run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert sum(reap_runs(SweepContext(rt, effects)).counts.values()) == 0  # idempotent


def test_detached_interrupted_run_is_aborted_and_reclaimed(
    rt: Runtime, effects: Recorder
) -> None:
    # Before: only running runs were reaped; a paused (interrupted) run whose viewer left
    # kept its sandbox active past LEASEKEEPER_RUN_DETACH_TTL_S, detached_since set, forever.
    lease_id = acquire(rt, "run-1")
    rt.store.set_detached("run-1", detached=True)
    finish(rt, "run-1", RunStatus.INTERRUPTED, None, None)
    effects.inline = True
    tally = reap_runs(SweepContext(rt, effects))
    assert tally[ReapOutcome.ABORTED_DETACHED] == 1
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.ABORTED and run.cancel_requested
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_viewer_that_came_back_before_the_claim_keeps_its_run(rt: Runtime) -> None:
    acquire(rt, "run-1")
    rt.store.set_detached("run-1", detached=True)
    cutoff = utcnow()
    claims = SweepStore(rt.store)
    decided = claims.due_detached_runs(cutoff, 10)
    assert decided == ["run-1"]
    rt.store.set_detached("run-1", detached=False)  # the viewer returns between decide and claim
    assert claims.claim_detached_runs(decided, cutoff, 5) == []
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.RUNNING and not run.cancel_requested


def test_viewer_that_left_again_restarts_the_ttl(rt: Runtime) -> None:
    acquire(rt, "run-1")
    old = utcnow() - timedelta(minutes=5)
    set_run(rt, "run-1", detached_since=old)
    cutoff = old + timedelta(minutes=1)
    claims = SweepStore(rt.store)
    decided = claims.due_detached_runs(cutoff, 10)
    set_run(rt, "run-1", detached_since=utcnow())  # came back, then left again just now
    assert claims.claim_detached_runs(decided, cutoff, 5) == []


def test_detached_run_of_a_reused_sandbox_is_aborted_but_the_sandbox_kept(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-1", reuse=True, thread_id="t-1")
    rt.store.set_detached("run-1", detached=True)
    tally = reap_runs(SweepContext(rt, effects))
    assert tally[ReapOutcome.ABORTED_DETACHED] == 1 and tally[ReapOutcome.RECLAIMS_ENQUEUED] == 0
    assert rt.store.get_run("run-1").reclaim_due is False
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE


def test_a_lost_reclaim_is_sent_again_once_its_claim_expires(
    rt: Runtime, effects: Recorder
) -> None:
    acquire(rt, "run-1")
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)  # its sandbox.reclaim is then lost
    assert reap_runs(SweepContext(rt, effects))[ReapOutcome.RECLAIMS_ENQUEUED] == 0  # claimed
    set_run(rt, "run-1", reclaim_claimed_until=utcnow())  # the claim runs out (inclusive)
    assert reap_runs(SweepContext(rt, effects))[ReapOutcome.RECLAIMS_ENQUEUED] == 1
    assert reap_runs(SweepContext(rt, effects))[ReapOutcome.RECLAIMS_ENQUEUED] == 0
    assert effects.reclaims == ["run-1"]


def test_overlapping_ticks_abort_and_reclaim_each_run_once(
    rt: Runtime, effects: Recorder
) -> None:
    leases = [acquire(rt, f"run-{i}") for i in range(6)]
    for i in range(6):
        rt.store.set_detached(f"run-{i}", detached=True)
    effects.inline = True
    tallies = concurrently([lambda: reap_runs(SweepContext(rt, effects))] * 3)
    assert sum(t[ReapOutcome.ABORTED_DETACHED] for t in tallies) == 6
    assert sorted(effects.reclaims) == sorted(f"run-{i}" for i in range(6))
    for lease_id in leases:  # each sandbox destroyed exactly once, by the history
        assert events_to(rt, lease_id, LeaseState.DESTROYING) == 1
        assert events_to(rt, lease_id, LeaseState.DESTROYED) == 1


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    acquire(rt, "run-1")
    rt.store.set_detached("run-1", detached=True)
    tally = reap_runs(SweepContext(rt, effects, dry_run=True))
    assert tally[ReapOutcome.ABORTED_DETACHED] == 1 and "aborted_detached run-1" in tally.items
    assert rt.store.get_run("run-1").status == RunStatus.RUNNING and effects.reclaims == []


def test_runs_left_unfinished_on_an_ended_lease_are_settled_once(
    rt: Runtime, effects: Recorder
) -> None:
    from tests.sweeps.conftest import set_lease

    running = acquire(rt, "run-running")
    paused = acquire(rt, "run-paused")
    live = acquire(rt, "run-live")
    finish(rt, "run-paused", RunStatus.INTERRUPTED, None, None)
    # Ended behind the system's back (a lost write, or rows from before the settling rule).
    set_lease(rt, running, state=LeaseState.DESTROYED, live_key=None, end_reason="expired")
    set_lease(rt, paused, state=LeaseState.ABANDONED, live_key=None, end_reason=None)
    dry = reap_runs(SweepContext(rt, effects, dry_run=True))
    assert dry[ReapOutcome.SETTLED] == 2
    assert rt.store.get_run("run-running").status == RunStatus.RUNNING  # a dry run writes nothing
    tally = reap_runs(SweepContext(rt, effects))
    assert tally[ReapOutcome.SETTLED] == 2 and effects.reclaims == []
    assert sorted(i for i in tally.items if i.startswith("settled")) == [
        "settled run-paused", "settled run-running"]
    run = rt.store.get_run("run-running")
    assert run.status == RunStatus.ABORTED and run.error == f"its lease {running} ended: expired"
    assert rt.store.get_run("run-paused").error == f"its lease {paused} ended: abandoned"
    assert rt.store.get_run("run-live").status == RunStatus.RUNNING
    assert rt.store.get_lease(live).state == LeaseState.ACTIVE
    assert reap_runs(SweepContext(rt, effects))[ReapOutcome.SETTLED] == 0
