"""Store conformance: the instance-store floor from the reference notes, plus guarded
transitions and claims, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from models.schema import LeaseState, RunStatus, utcnow
from models.store import LiveLeaseExists, NewLease, RunChange, Store
from models.sweep_store import SweepStore
from providers.errors import InvalidRequest, NotFound


@pytest.fixture
def store(store_url: str) -> Store:
    s = Store(store_url)
    yield s
    s.dispose()


def intent(store: Store, lease_id: str, key: str, run_id: str = "run-1") -> None:
    store.start_run(run_id, "thread-1", "local", key)
    store.create_intent(NewLease(
        lease_id=lease_id, sandbox_key=key, provider="local",
        provider_lease_id=f"lk-{lease_id}", reuse=True, tenant="acme", thread_id="thread-1",
        run_id=run_id, spec={"tenant": "acme"}, acquire_deadline_at=utcnow(),
        deadline_at=utcnow() + timedelta(hours=1), idle_timeout_s=60,
    ), task_id="t-1")


def test_missing_key_is_none(store: Store) -> None:
    assert store.live_lease_for_key("nope") is None
    assert store.get_run("nope") is None
    with pytest.raises(NotFound, match="no lease 'nope'"):
        store.get_lease("nope")


def test_round_trip_keeps_fields_and_absent_optionals(store: Store) -> None:
    intent(store, "l1", "k1")
    lease = store.get_lease("l1")
    assert (lease.sandbox_key, lease.provider, lease.provider_lease_id, lease.state) == (
        "k1", "local", "lk-l1", LeaseState.PROVISIONING)
    assert lease.tenant == "acme" and lease.thread_id == "thread-1" and lease.run_id == "run-1"
    assert lease.ready_at is None and lease.idle_deadline_at is None and lease.last_error is None
    assert store.live_lease_for_key("k1").lease_id == "l1"
    assert store.get_run("run-1").lease_id == "l1"


def test_transition_overwrites_and_clears_optionals(store: Store) -> None:
    intent(store, "l1", "k1")
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready",
                     provider_meta={"pid": 1}, ready_at=utcnow(), last_error="old")
    moved = store.transition("l1", {LeaseState.ACTIVE}, LeaseState.ACTIVE, "refresh",
                             provider_meta={}, last_error=None)
    assert moved.provider_meta == {} and moved.last_error is None


def test_live_leases_are_unique_per_key_and_isolated_by_key(store: Store) -> None:
    intent(store, "l1", "k1")
    intent(store, "l2", "k2", run_id="run-2")
    with pytest.raises(LiveLeaseExists, match="k1"):
        intent(store, "l3", "k1", run_id="run-3")
    assert store.live_lease_for_key("k2").lease_id == "l2"
    # Once not live, the key is free for a new lease.
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, "x")
    intent(store, "l3", "k1", run_id="run-3")
    assert store.live_lease_for_key("k1").lease_id == "l3"


def test_guarded_transition_has_one_winner(store: Store) -> None:
    intent(store, "l1", "k1")
    results: list[object] = []

    def claim() -> None:
        results.append(store.transition("l1", {LeaseState.PROVISIONING},
                                        LeaseState.DESTROYING, "race"))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is not None for r in results) == 1
    assert store.get_lease("l1").state == LeaseState.DESTROYING


def test_every_change_is_an_event(store: Store) -> None:
    intent(store, "l1", "k1")
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready", task_id="t-2")
    assert store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "again") is None
    store.transition("l1", {LeaseState.ACTIVE}, LeaseState.DESTROYED, "gone", task_id="t-3")
    events = [(e.from_state, e.to_state, e.task_id) for e in store.events("l1")]
    assert events == [(None, "provisioning", "t-1"), ("provisioning", "active", "t-2"),
                      ("active", "destroyed", "t-3")]


def test_final_lease_is_kept_but_frees_its_key(store: Store) -> None:
    intent(store, "l1", "k1")
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.DESTROYED, "gone")
    assert store.live_lease_for_key("k1") is None
    assert store.get_lease("l1").state == LeaseState.DESTROYED


def test_run_finish_is_idempotent_and_guarded(store: Store) -> None:
    store.start_run("r1", None, "local", "k")
    assert store.start_run("r1", None, "local", "k").status == RunStatus.RUNNING
    assert store.finish_run("r1", RunStatus.COMPLETED, 0, None, True, None) == RunChange.CHANGED
    assert store.finish_run("r1", RunStatus.FAILED, 1, None, True, None) == RunChange.UNCHANGED
    run = store.get_run("r1")
    assert (run.status, run.exit_code, run.reclaim_due) == (RunStatus.COMPLETED, 0, True)
    with pytest.raises(NotFound):
        store.finish_run("missing", RunStatus.COMPLETED, 0, None, True, None)


def test_detached_cutoff_is_inclusive_and_rechecked(store: Store) -> None:
    claims = SweepStore(store)
    store.start_run("r1", None, "local", "k1")
    store.start_run("r2", None, "local", "k2")
    store.set_detached("r1", detached=True)
    store.set_detached("r2", detached=True)
    r1 = store.get_run("r1")
    decided = claims.due_detached_runs(r1.detached_since, 10)
    assert "r1" in decided  # detached_since == cutoff counts (inclusive)
    store.set_detached("r2", detached=False)  # the viewer came back before the claim
    claimed = claims.claim_detached_runs(["r1", "r2"], r1.detached_since, 5)
    assert claimed == [("r1", True)]
    assert store.get_run("r1").status == RunStatus.ABORTED
    assert store.get_run("r2").status == RunStatus.RUNNING
    assert claims.claim_detached_runs(["r1"], utcnow(), 5) == []  # claimed once only


def test_cleanup_claims_are_exclusive(store: Store) -> None:
    claims = SweepStore(store)
    for i in range(5):
        intent(store, f"l{i}", f"k{i}", run_id=f"run-{i}")
        store.transition(f"l{i}", {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, "x",
                         next_cleanup_at=utcnow() - timedelta(seconds=10 - i))
    first = claims.claim_cleanups(claims.due_cleanups(utcnow(), 3), utcnow(), 60)
    second = claims.claim_cleanups(claims.due_cleanups(utcnow(), 3), utcnow(), 60)
    assert first == ["l0", "l1", "l2"]  # oldest first, bounded batch
    assert sorted(second) == ["l3", "l4"]
    assert claims.claim_cleanups(["l0", "l1", "l2", "l3", "l4"], utcnow(), 60) == []


def test_concurrent_claims_of_the_same_rows_never_both_win(store: Store) -> None:
    claims = SweepStore(store)
    ids = [f"l{i}" for i in range(8)]
    for i, lease_id in enumerate(ids):
        intent(store, lease_id, f"k{i}", run_id=f"run-{i}")
        store.transition(lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, "x",
                         next_cleanup_at=utcnow())
    won: list[list[str]] = []
    barrier = threading.Barrier(4)

    def claim() -> None:
        barrier.wait()
        won.append(claims.claim_cleanups(ids, utcnow(), 60))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(lease_id for batch in won for lease_id in batch) == ids  # each exactly once


def test_an_intent_never_binds_a_run_that_ended(store: Store) -> None:
    # given a run that ended before its acquire recorded a lease (sweep.reap_runs failed it)
    store.start_run("run-1", "thread-1", "local", "k1")
    assert store.fail_leaseless_run("run-1", "gave up") == RunChange.CHANGED
    # when a late acquire records its intent: refused, and nothing is written
    with pytest.raises(InvalidRequest, match="run run-1 is no longer running"):
        intent(store, "l1", "k1", run_id="run-1")  # its start_run finds the failed run
    with pytest.raises(NotFound):
        store.get_lease("l1")
    assert store.get_run("run-1").status == RunStatus.FAILED
    # and a run with a lease is never failed as lease-less
    intent(store, "l2", "k2", run_id="run-2")
    assert store.fail_leaseless_run("run-2", "gave up") == RunChange.UNCHANGED

