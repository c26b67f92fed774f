"""The exporter reads the lease event log by id exactly once, even when ids commit out of
order (PostgreSQL sequences): a skipped id is read when it appears, or given up later.
Reclaim outcomes, stamped before commit, are counted once each, late commits included."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import insert, update

from models.observe import Observe
from models.schema import LeaseEvent, LeaseState, Run, utcnow
from models.store import NewLease, Store
from workers.metrics.tail import IdTail, ReclaimTail


def _lease(store: Store, lease_id: str) -> None:
    now = utcnow()
    store.create_intent(NewLease(
        lease_id=lease_id, sandbox_key=f"sk-{lease_id}", provider="local",
        provider_lease_id=f"lk-{lease_id}", reuse=False, tenant="acme", thread_id=None,
        run_id=f"run-{lease_id}", spec={}, acquire_deadline_at=now + timedelta(minutes=1),
        deadline_at=now + timedelta(hours=1), idle_timeout_s=60), task_id=None)


def _event(store: Store, event_id: int, lease_id: str) -> None:
    """An event row with an explicit id: a commit that landed late."""
    with store.tx() as s:
        s.execute(insert(LeaseEvent).values(id=event_id, lease_id=lease_id, at=utcnow(),
                                            from_state=LeaseState.PROVISIONING,
                                            to_state=LeaseState.ACTIVE, reason="test"))


def test_late_commits_are_read_once_and_old_gaps_given_up(store_url: str) -> None:
    store = Store(store_url)
    observe = Observe(store)
    _lease(store, "a1")  # event id 1
    now = [0.0]
    tail = IdTail(observe.max_event_id() + 1, gap_grace_s=30, clock=lambda: now[0])
    assert tail.next_id == 2
    _event(store, 5, "a1")
    assert [e.id for e in tail.poll(observe.events_from, 100)] == [5]
    assert tail.gaps == [2, 3, 4] and tail.next_id == 2

    _event(store, 3, "a1")  # committed after 5
    now[0] = 10
    assert [e.id for e in tail.poll(observe.events_from, 2)] == [3]  # 5 is not counted twice
    assert tail.gaps == [2, 4]

    now[0] = 45  # 2 and 4 were rolled back: given up after the grace period
    assert tail.poll(observe.events_from, 100) == []
    assert tail.gaps == [] and tail.next_id == 6
    _event(store, 6, "a1")
    assert [(e.id, e.provider, e.to_state) for e in tail.poll(observe.events_from, 1)] == [
        (6, "local", "active")]
    store.dispose()


def test_reclaims_are_counted_once_including_late_commits(store_url: str) -> None:
    store = Store(store_url)
    observe = Observe(store)
    start = utcnow() - timedelta(seconds=10)  # the exporter started 10 s ago
    tail = ReclaimTail(start)
    for run_id in ("r1", "r2", "r3"):
        store.start_run(run_id, None, "local", f"sk-{run_id}")
    with store.tx() as s:  # reclaimed before the exporter started: not counted
        s.execute(update(Run).where(Run.run_id == "r3").values(
            reclaim_outcome="not-found", reclaimed_at=start - timedelta(seconds=5)))
    store.record_reclaim("r1", "destroyed")
    assert tail.poll(observe.reclaims_since) == ["destroyed"]
    assert tail.poll(observe.reclaims_since) == []  # not twice
    newest = store.get_run("r1").reclaimed_at
    with store.tx() as s:  # stamped before r1's, committed after it
        s.execute(update(Run).where(Run.run_id == "r2").values(
            reclaim_outcome="provider-mismatch", reclaimed_at=newest - timedelta(seconds=1)))
    assert tail.poll(observe.reclaims_since) == ["provider-mismatch"]
    store.dispose()


def test_sweep_tick_log_keeps_the_newest_ticks_of_each_sweep(store_url: str) -> None:
    store = Store(store_url)
    observe = Observe(store)
    for n in range(4):
        observe.record_tick("sweep.orphans", "ran", n, {"recorded": n}, {"items": []}, None, 2)
    observe.record_tick("sweep.reap_runs", "failed", 0, {}, {"error": "x"}, "t-1", 2)
    assert [t.counts["recorded"] for t in observe.recent_ticks("sweep.orphans", 10)] == [3, 2]
    assert [t.run for t in observe.recent_ticks("sweep.reap_runs", 10)] == ["failed"]
    assert {(sweep, run) for sweep, run, _at in observe.last_ticks()} == {
        ("sweep.orphans", "ran"), ("sweep.reap_runs", "failed")}
    store.dispose()

