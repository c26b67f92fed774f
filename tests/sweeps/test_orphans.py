"""sweep.orphans: provider resources no lease accounts for, older than the grace period,
are recorded as orphan leases and destroyed through the normal path; a destroyed lease's
resource that is still there is cleaned up again; young ones are never touched."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import delete

from models.schema import Lease, LeaseEvent, LeaseState, Run, utcnow
from models.sweep_store import SweepStore
from providers.base import AcquireRequest
from providers.spec import SandboxSpec
from tasks.destroy import destroy_lease
from tasks.orphans import OrphanOutcome, orphans
from tasks.sweeping import SweepContext
from tests.sweeps.conftest import Recorder, acquire, concurrently, events_to
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def forget_behind_our_back(rt: Runtime, lease_id: str) -> None:
    """Delete the lease's rows (lease, events, run) as a careless script would."""
    with rt.store.tx() as s:
        s.execute(delete(LeaseEvent).where(LeaseEvent.lease_id == lease_id))
        s.execute(delete(Run).where(Run.lease_id == lease_id))
        s.execute(delete(Lease).where(Lease.lease_id == lease_id))


def age(rt: Runtime, lease_id: str, seconds: float, provider: str = "local") -> None:
    """Make the resource look created ``seconds`` ago."""
    root = Path(rt.settings.effective_local_root) / ("faulty" if provider == "faulty" else "")
    record = root / f"lk-{lease_id}" / "lease.json"
    data = json.loads(record.read_text())
    created = datetime.now(UTC) - timedelta(seconds=seconds)
    record.write_text(json.dumps({**data, "created_at": created.isoformat()}))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"


def test_orphan_is_recorded_and_destroyed(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1", tenant="acme")
    pid = rt.store.get_lease(lease_id).provider_meta["pid"]
    forget_behind_our_back(rt, lease_id)
    age(rt, lease_id, 61)
    effects.inline = True
    tally = orphans(SweepContext(rt, effects))
    assert tally[OrphanOutcome.RECORDED] == 1
    lease = rt.store.get_lease(lease_id)  # recorded under the id its label carries
    assert (lease.state, lease.end_reason, lease.provider, lease.backend, lease.tenant) == (
        LeaseState.DESTROYED, "orphan", "local", "process", "acme")
    assert lease.provider_lease_id == f"lk-{lease_id}" and lease.provider_meta["pid"] == pid
    history = [(e.from_state, e.to_state) for e in rt.store.events(lease_id)]
    assert history == [(None, "pending_cleanup"), ("pending_cleanup", "destroying"),
                       ("destroying", "destroyed")]
    assert "no lease in the store accounts for it" in rt.store.events(lease_id)[0].reason
    assert not pid_alive(pid) and rt.provider("local").list_managed() == []
    assert sum(orphans(SweepContext(rt, effects)).counts.values()) == 0


def test_grace_period_is_respected_and_inclusive(runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(orphan_grace_s=60)
    effects = Recorder(rt)
    young, old = acquire(rt, "run-young"), acquire(rt, "run-old")
    for lease_id in (young, old):
        forget_behind_our_back(rt, lease_id)
    age(rt, young, 50)
    age(rt, old, 60)  # exactly the grace (the listing happens a moment later): old enough
    tally = orphans(SweepContext(rt, effects))
    assert tally[OrphanOutcome.WITHIN_GRACE] == 1 and tally[OrphanOutcome.RECORDED] == 1
    assert [lid for lid, _ in effects.destroys] == [old]
    assert rt.store.find_lease(young) is None


def test_resources_of_live_cleaning_and_abandoned_leases_are_left_alone(
    rt: Runtime, effects: Recorder
) -> None:
    live = acquire(rt, "run-live")
    cleaning = acquire(rt, "run-cleaning")
    abandoned = acquire(rt, "run-abandoned")
    rt.store.transition(cleaning, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP, "x",
                        next_cleanup_at=utcnow() + timedelta(hours=1))
    rt.store.transition(abandoned, {LeaseState.ACTIVE}, LeaseState.ABANDONED, "x")
    for lease_id in (live, cleaning, abandoned):
        age(rt, lease_id, 3600)
    tally = orphans(SweepContext(rt, effects))
    assert tally[OrphanOutcome.TRACKED] == 2 and tally[OrphanOutcome.LEFT_FOR_OPERATOR] == 1
    assert tally[OrphanOutcome.RECORDED] == 0 and effects.destroys == []


def reappear(rt: Runtime, lease_id: str) -> None:
    provider = rt.provider("local")
    provider.acquire(AcquireRequest(lease_id=lease_id, name=provider.lease_name(lease_id),
                                    spec=SandboxSpec(), labels={}, timeout_s=10))
    age(rt, lease_id, 3600)


def test_resource_back_after_its_destroy_is_destroyed_again_until_the_cap(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-1")
    destroy_lease(rt, lease_id, "done", None)
    effects.inline = True
    for attempt in (1, 2):
        reappear(rt, lease_id)
        tally = orphans(SweepContext(rt, effects))
        assert tally[OrphanOutcome.REVIVED] == 1
        lease = rt.store.get_lease(lease_id)
        assert lease.state == LeaseState.DESTROYED and lease.cleanup_attempts == attempt
        assert rt.provider("local").list_managed() == []
    reappear(rt, lease_id)  # the third time (cap 3): left for an operator, counted
    assert orphans(SweepContext(rt, effects))[OrphanOutcome.ABANDONED] == 1
    assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "still lists") == 2


def test_a_destroy_recorded_after_the_listing_is_not_revived(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    listed_at = utcnow()  # the sweep listed while the destroy was still under way
    destroy_lease(rt, lease_id, "done", None)
    claims = SweepStore(rt.store)
    assert claims.revive(lease_id, listed_at, "x", utcnow(), 5, 3, None) is None
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_a_process_whose_workspace_was_deleted_is_still_found(
    rt: Runtime, runtime_with: Callable[..., Runtime]
) -> None:
    import shutil

    lease_id = acquire(rt, "run-1")
    pid = rt.store.get_lease(lease_id).provider_meta["pid"]
    forget_behind_our_back(rt, lease_id)
    shutil.rmtree(Path(rt.settings.effective_local_root) / f"lk-{lease_id}")
    (stray,) = rt.provider("local").list_managed()
    assert stray.lease_id == lease_id and stray.meta["stray_pids"] and stray.created_at
    rt2 = runtime_with(orphan_grace_s=0.01)
    effects2 = Recorder(rt2, inline=True)
    assert orphans(SweepContext(rt2, effects2))[OrphanOutcome.RECORDED] == 1
    assert not pid_alive(pid) and rt.provider("local").list_managed() == []
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_overlapping_ticks_record_and_destroy_each_orphan_once(
    rt: Runtime, effects: Recorder
) -> None:
    leases = [acquire(rt, f"run-{i}") for i in range(5)]
    for lease_id in leases:
        forget_behind_our_back(rt, lease_id)
        age(rt, lease_id, 3600)
    tallies = concurrently([lambda: orphans(SweepContext(rt, effects))] * 3)
    assert sum(t[OrphanOutcome.RECORDED] for t in tallies) == 5
    assert sorted(lid for lid, _ in effects.destroys) == sorted(leases)
    for lease_id in leases:
        assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "orphan") == 1


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1")
    forget_behind_our_back(rt, lease_id)
    age(rt, lease_id, 3600)
    tally = orphans(SweepContext(rt, effects, dry_run=True))
    assert tally[OrphanOutcome.RECORDED] == 1 and effects.destroys == []
    assert rt.store.find_lease(lease_id) is None
    assert rt.provider("local").list_managed()[0].meta["alive"]


def test_revive_takes_the_backend_and_metadata_the_listing_reports_now(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-1")
    destroy_lease(rt, lease_id, "done", None)
    old_meta = rt.store.get_lease(lease_id).provider_meta
    reappear(rt, lease_id)  # a new process under the same name: another pid, another start
    (listed,) = rt.provider("local").list_managed()
    assert orphans(SweepContext(rt, effects))[OrphanOutcome.REVIVED] == 1
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.backend == listed.backend
    assert lease.provider_meta == listed.meta and lease.provider_meta["pid"] != old_meta["pid"]
