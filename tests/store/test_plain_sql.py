"""The store's plain-SQL hot path (models/rawsql.py) keeps every promise of a guarded
transition, on SQLite and PostgreSQL alike: the event names the state really left, a
lease end settles its runs in the same change, the first end reason wins, and a new run
with its intent is all or nothing."""

from __future__ import annotations

import gc
import itertools
import threading
import uuid
from dataclasses import fields
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text, update

from models.migrate import upgrade
from models.schema import (
    ClaimedLease,
    Lease,
    LeaseRecord,
    LeaseState,
    ReclaimOutcome,
    Run,
    RunStatus,
    utcnow,
)
from models.store import LiveLeaseExists, NewLease, Store
from providers.errors import NotFound, StoreUnavailable
from tests.services import PostgresServer


@pytest.fixture
def store(store_url: str) -> Store:
    s = Store(store_url)
    yield s
    s.dispose()


def new_lease(lease_id: str, key: str, run_id: str) -> NewLease:
    return NewLease(
        lease_id=lease_id, sandbox_key=key, provider="local",
        provider_lease_id=f"lk-{lease_id}", reuse=False, tenant="acme", thread_id="t-1",
        run_id=run_id, spec={"tenant": "acme", "labels": {"team": "a"}},
        acquire_deadline_at=utcnow(), deadline_at=utcnow() + timedelta(hours=1),
        idle_timeout_s=60)


def test_a_lease_record_has_every_lease_column_in_order() -> None:
    assert [f.name for f in fields(LeaseRecord)] == [c.name for c in Lease.__table__.c]


def test_a_new_run_and_its_intent_are_written_together(store: Store) -> None:
    # when a new run gets its intent
    new = new_lease("l1", "k1", "run-1")
    assert store.start_run_with_intent("run-1", new, "task-1") is True
    # then both exist, bound, with the intent's event
    lease, run = store.get_lease("l1"), store.get_run("run-1")
    assert run is not None and run.lease_id == "l1" and run.status == RunStatus.RUNNING
    assert lease.spec == {"tenant": "acme", "labels": {"team": "a"}} and lease.live_key == "k1"
    assert lease.provider_meta == {} and lease.reuse is False and lease.version == 1
    assert [(e.from_state, e.to_state, e.task_id) for e in store.events("l1")] == [
        (None, LeaseState.PROVISIONING, "task-1")]
    # the intent is what the store holds (the acquire goes on with it, reading nothing)
    assert lease.state == LeaseState.PROVISIONING and lease.prev_state is None
    for field in fields(new):
        assert getattr(lease, field.name) == getattr(new, field.name), field.name


def test_a_run_records_whether_its_acquire_carried_secret_env(store: Store) -> None:
    # A run's own secret_env is recorded with the run, whichever insert writes it (the
    # hot path's intent, or the general path's run row), for tasks/secret_marks.lost.
    with_secrets = new_lease("l1", "k1", "run-1")
    with_secrets.spec["secret_env"] = {"API_TOKEN": "***"}
    store.start_run_with_intent("run-1", with_secrets, None)
    store.start_run_with_intent("run-2", new_lease("l2", "k2", "run-2"), None)
    assert store.start_run("run-3", "t-1", "local", "k2", True).secret_env_given is True
    assert store.start_run("run-4", "t-1", "local", "k2").secret_env_given is False
    assert [store.get_run(r).secret_env_given for r in ("run-1", "run-2", "run-3", "run-4")
            ] == [True, False, True, False]  # type: ignore[union-attr]
    assert store.secrets_given("run-1", None) and not store.secrets_given("run-2", "l2")
    # a shared sandbox's later run that brought secrets of its own counts for its lease
    store.transition("l2", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
    store.bind_run("run-3", "l2", "k2")
    assert store.secrets_given(None, "l2") and store.secrets_given("run-2", "l2")
    assert not store.secrets_given(None, None) and not store.secrets_given("run-4", "nope")


def test_an_existing_run_writes_nothing_and_a_taken_key_writes_nothing(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    # an existing run: nothing written, the caller takes the general path
    assert store.start_run_with_intent("run-1", new_lease("l2", "k2", "run-1"), None) is False
    with pytest.raises(NotFound):
        store.get_lease("l2")
    # a key with a live lease: refused, and not even the new run is left behind
    with pytest.raises(LiveLeaseExists, match="'k1' already has a live lease"):
        store.start_run_with_intent("run-2", new_lease("l3", "k1", "run-2"), None)
    assert store.get_run("run-2") is None
    with pytest.raises(NotFound):
        store.get_lease("l3")


def test_the_event_names_the_state_really_left(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
    # when the lease may be in one of several states
    moved = store.transition("l1", {LeaseState.PROVISIONING, LeaseState.ACTIVE,
                                    LeaseState.PENDING_CLEANUP},
                             LeaseState.DESTROYING, "destroy", first_end_reason="requested")
    # then the event says it left active, and the end reason is set
    assert moved is not None and moved.state == LeaseState.DESTROYING
    assert moved.end_reason == "requested" and moved.live_key is None and moved.version == 3
    assert store.events("l1")[-1].from_state == LeaseState.ACTIVE


def test_a_destroy_claim_reads_back_what_a_destroy_needs(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.move("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready", backend="proc",
               provider_meta={"pid": 42, "dir": "/x"})
    # when a destroy claims the lease
    claimed = store.claim_to_destroy("l1", {LeaseState.ACTIVE, LeaseState.PENDING_CLEANUP},
                                     "destroy: requested", "task-9", first_end_reason="requested")
    # then it reads the lease's provider, handle and attempts, as the store now holds them
    lease = store.get_lease("l1")
    assert claimed == ClaimedLease(
        prev_state=LeaseState.ACTIVE, end_reason="requested", lease_id="l1",
        provider="local", provider_lease_id="lk-l1", backend="proc",
        provider_meta={"pid": 42, "dir": "/x"}, spec={"tenant": "acme", "labels": {"team": "a"}},
        cleanup_attempts=0)
    assert (lease.state, lease.end_reason, lease.live_key) == (
        LeaseState.DESTROYING, "requested", None)
    assert [(e.from_state, e.to_state, e.reason, e.task_id) for e in store.events("l1")][-1] == (
        LeaseState.ACTIVE, LeaseState.DESTROYING, "destroy: requested", "task-9")
    # and a second claim, or one of a missing lease, takes nothing
    assert store.claim_to_destroy("l1", {LeaseState.ACTIVE}, "again", None, "x") is None
    with pytest.raises(NotFound, match="no lease 'nope'"):
        store.claim_to_destroy("nope", {LeaseState.ACTIVE}, "x", None, "x")


def test_a_claim_bound_to_a_run_waits_for_a_rebinding_and_then_takes_nothing(
    store: Store,
) -> None:
    # a reclaim's claim (bound to run-1) while a reuse's transaction binds the lease to
    # run-2 and has not committed yet: it waits for it, then sees the lease is run-2's
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.move("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
    store.start_run("run-2", "t-1", "local", "k1")
    binding = threading.Event()
    release = threading.Event()

    def bind_slowly() -> None:
        with store.tx() as s:
            s.execute(update(Lease).where(Lease.lease_id == "l1").values(run_id="run-2"))
            s.execute(update(Run).where(Run.run_id == "run-2").values(lease_id="l1"))
            binding.set()
            release.wait(10)

    binder = threading.Thread(target=bind_slowly)
    binder.start()
    assert binding.wait(10)
    claims: list[object] = []
    claimer = threading.Thread(target=lambda: claims.append(store.claim_to_destroy(
        "l1", {LeaseState.ACTIVE}, "destroy: reclaim", None, "reclaim", bound_to="run-1")))
    claimer.start()
    claimer.join(0.5)
    assert claimer.is_alive()  # it waits for the binding transaction
    release.set()
    binder.join(10)
    claimer.join(10)
    assert claims == [None]
    lease = store.get_lease("l1")
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, "run-2")
    # while bound to the run it names, the claim takes the lease
    assert store.claim_to_destroy("l1", {LeaseState.ACTIVE}, "destroy: reclaim", None,
                                  "reclaim", bound_to="run-2") is not None


def test_the_first_end_reason_wins(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP,
                     "acquire failed", end_reason="acquire_failed")
    moved = store.transition("l1", {LeaseState.PENDING_CLEANUP}, LeaseState.DESTROYING,
                             "retry", first_end_reason="requested")
    assert moved is not None and moved.end_reason == "acquire_failed"


def test_a_state_that_moved_on_or_a_missing_lease_writes_nothing(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    before = len(store.events("l1"))
    assert store.transition("l1", {LeaseState.ACTIVE}, LeaseState.DESTROYING, "x") is None
    assert store.transition("l1", {LeaseState.ACTIVE, LeaseState.DESTROYING},
                            LeaseState.DESTROYED, "x") is None
    assert len(store.events("l1")) == before
    assert store.get_lease("l1").version == 1
    with pytest.raises(NotFound, match="no lease 'nope'"):
        store.transition("nope", {LeaseState.ACTIVE}, LeaseState.DESTROYING, "x")
    with pytest.raises(NotFound, match="no lease 'nope'"):
        store.transition("nope", {LeaseState.ACTIVE, LeaseState.PROVISIONING},
                         LeaseState.DESTROYING, "x")


def test_a_move_is_the_same_change_without_the_row(store: Store) -> None:
    """Store.move (the acquire's activation, the destroy's end) writes what transition
    writes: the guarded change, the event naming the state left, the runs settled."""
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), "t-0")
    # when the lease is activated, claimed for destroy and destroyed by moves
    assert store.move("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready", "t-1",
                      backend="job", ready_at=utcnow()) is True
    assert store.move("l1", {LeaseState.ACTIVE, LeaseState.PENDING_CLEANUP},
                      LeaseState.DESTROYING, "destroy", "t-2", "requested") is True
    assert store.move("l1", {LeaseState.DESTROYING}, LeaseState.DESTROYED, "destroyed",
                      "t-3", next_cleanup_at=None) is True
    # then the row, its history and its run are as after transitions
    lease, run = store.get_lease("l1"), store.get_run("run-1")
    assert (lease.state, lease.backend, lease.end_reason, lease.live_key, lease.version) == (
        LeaseState.DESTROYED, "job", "requested", None, 4)
    assert [(e.from_state, e.to_state, e.task_id) for e in store.events("l1")] == [
        (None, LeaseState.PROVISIONING, "t-0"),
        (LeaseState.PROVISIONING, LeaseState.ACTIVE, "t-1"),
        (LeaseState.ACTIVE, LeaseState.DESTROYING, "t-2"),
        (LeaseState.DESTROYING, LeaseState.DESTROYED, "t-3")]
    assert run is not None and run.status == RunStatus.ABORTED
    assert run.error == "its lease l1 ended: requested"
    # and a move that finds the lease moved on writes nothing; no lease is NotFound
    assert store.move("l1", {LeaseState.DESTROYING}, LeaseState.DESTROYED, "again") is False
    assert len(store.events("l1")) == 4
    with pytest.raises(NotFound, match="no lease 'nope'"):
        store.move("nope", {LeaseState.ACTIVE}, LeaseState.DESTROYING, "x")


def test_a_lease_end_settles_its_runs_in_the_same_change(store: Store) -> None:
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
    # a finished run on the lease whose reclaim failed, and a running one
    store.start_run("run-2", "t-1", "local", "k1")
    store.bind_run("run-2", "l1", "k1")
    with store.tx() as s:
        s.execute(update(Run).where(Run.run_id == "run-1").values(
            status=RunStatus.COMPLETED, reclaim_outcome=ReclaimOutcome.DESTROY_FAILED))
    store.transition("l1", {LeaseState.ACTIVE}, LeaseState.DESTROYING, "destroy",
                     first_end_reason="requested")
    # when the destroy takes
    store.transition("l1", {LeaseState.DESTROYING}, LeaseState.DESTROYED, "destroyed")
    # then the running run is aborted with the lease's end reason, the failed reclaim is
    # destroyed now, and the event says so
    run1, run2 = store.get_run("run-1"), store.get_run("run-2")
    assert run1 is not None and run1.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert run1.status == RunStatus.COMPLETED
    assert run2 is not None and run2.status == RunStatus.ABORTED
    assert run2.error == "its lease l1 ended: requested" and run2.finished_at is not None
    assert store.events("l1")[-1].reason == (
        "destroyed (reclaim of run run-1: destroy-failed → destroyed)")
    # and a destroyed lease found again flips it back until a destroy really takes
    store.transition("l1", {LeaseState.DESTROYED}, LeaseState.PENDING_CLEANUP, "still there")
    run1 = store.get_run("run-1")
    assert run1 is not None and run1.reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    assert "reclaim of run run-1: destroyed → destroy-failed" in store.events("l1")[-1].reason


@pytest.mark.postgres
def test_a_dropped_connection_fails_one_call_then_reconnects(
        postgres_server: PostgresServer) -> None:
    postgres_store_url = postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(postgres_store_url)
    store = Store(postgres_store_url)
    try:
        store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
        # when the server ends the hot path's connection (as a restart would)
        plain = postgres_store_url.replace("+psycopg", "")
        with psycopg.connect(plain, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        # then that call fails as unavailable, saying the task will retry, and writes nothing
        with pytest.raises(StoreUnavailable, match=r"unavailable.*will retry"):
            store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
        assert store.get_lease("l1").state == LeaseState.PROVISIONING
        # and the next one works on a new connection
        assert store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                                "ready") is not None
    finally:
        store.dispose()


@pytest.mark.postgres
def test_a_hot_connection_back_in_the_pool_gives_sessions_transactions_again(
        postgres_server: PostgresServer) -> None:
    """The hot path's connection is in autocommit; when its thread ends it goes back to
    the pool, and the next session on it must get real transactions (a filler's
    SELECT ... FOR UPDATE would otherwise lock nothing: pools overshot max_size)."""
    url = postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(url)
    store = Store(url)
    try:
        # given a thread that used the hot path, then ended
        worker = threading.Thread(target=lambda: store.start_run_with_intent(
            "run-1", new_lease("l1", "k1", "run-1"), None))
        worker.start()
        worker.join()
        del worker
        gc.collect()
        assert store.engine.pool.checkedout() == 0
        # when a session takes a connection from the pool (the only one there)
        with store.tx() as s:
            first = s.execute(text("SELECT txid_current()")).scalar()
            second = s.execute(text("SELECT txid_current()")).scalar()
        # then its statements share one transaction
        assert first == second
    finally:
        store.dispose()


@pytest.mark.postgres
def test_a_pooled_connection_taken_again_by_the_hot_path_prepares_its_statements_anew(
        postgres_server: PostgresServer) -> None:
    """The hot path prepares its statements on its connection (models/pq_cursor.py); a
    connection back in the pool keeps them, and the hot path that takes it next must not
    collide with them, nor with psycopg's own."""
    url = postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(url)
    store = Store(url)
    try:
        # given a hot connection that ran the common statements, then went back to the pool
        store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
        store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
        hot = store._local.hot
        pid = hot.driver.info.backend_pid
        store._drop_hot(hot)
        # when the hot path takes the same server connection again
        assert store._hot().driver.info.backend_pid == pid
        store.start_run_with_intent("run-2", new_lease("l2", "k2", "run-2"), None)
        moved = store.transition("l2", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
        # then the same statements run, values read as psycopg reads them
        assert moved is not None and moved.state == LeaseState.ACTIVE
        assert moved == LeaseRecord(**{c.name: getattr(store.get_lease("l2"), c.name)
                                       for c in Lease.__table__.c})
        # and a key taken is psycopg's IntegrityError there too: nothing written
        with pytest.raises(LiveLeaseExists):
            store.start_run_with_intent("run-3", new_lease("l3", "k2", "run-3"), None)
        assert store.get_run("run-3") is None
    finally:
        store.dispose()


def test_a_failed_reclaim_recorded_after_its_lease_was_destroyed_is_destroyed(
        store: Store) -> None:
    """Two reclaims of one run race: one's destroy fails, the other's (or a retry's)
    succeeds and its transition finds nothing to correct yet; the failure recorded after
    it must not leave ``destroy-failed`` on a destroyed lease (the chaos proof's check
    caught it)."""
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.DESTROYING, "destroy")
    store.transition("l1", {LeaseState.DESTROYING}, LeaseState.DESTROYED, "destroyed")
    assert store.record_reclaim("run-1", ReclaimOutcome.DESTROY_FAILED) == "destroyed"
    run = store.get_run("run-1")
    assert run is not None and run.reclaim_outcome == ReclaimOutcome.DESTROYED
    # a failure on a lease still waiting for cleanup stays a failure
    store.start_run_with_intent("run-2", new_lease("l2", "k2", "run-2"), None)
    store.transition("l2", {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, "failed")
    assert store.record_reclaim("run-2", ReclaimOutcome.DESTROY_FAILED) == "destroy-failed"


def test_racing_changes_leave_a_history_where_each_event_starts_where_the_last_ended(
        store: Store) -> None:
    # given an active lease, and threads racing to move it along different edges (each
    # on its own connection: PostgreSQL makes a loser wait, then re-check the newest row)
    store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
    edges = [({LeaseState.ACTIVE, LeaseState.PENDING_CLEANUP}, LeaseState.DESTROYING),
             ({LeaseState.ACTIVE, LeaseState.DESTROYING}, LeaseState.PENDING_CLEANUP),
             ({LeaseState.DESTROYING, LeaseState.PENDING_CLEANUP}, LeaseState.ACTIVE)]
    barrier = threading.Barrier(6)

    def race(expected: set[LeaseState], to: LeaseState) -> None:
        barrier.wait()
        for _ in range(15):
            store.transition("l1", expected, to, f"to {to}")

    threads = [threading.Thread(target=race, args=edges[i % 3]) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # then every event names the state the one before it reached: no change is lost or
    # told twice, whoever won each race
    events = store.events("l1")
    assert len(events) > 3
    assert all(a.to_state == b.from_state for a, b in itertools.pairwise(events))
    lease = store.get_lease("l1")
    assert lease.state == events[-1].to_state and lease.prev_state == events[-1].from_state
    assert lease.version == len(events)  # every move, and only the moves, counted
    # and the live key followed liveness through it all
    assert lease.live_key == ("k1" if lease.state == LeaseState.ACTIVE else None)
