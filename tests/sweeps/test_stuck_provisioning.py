"""sweep.stuck_provisioning: a lease left provisioning past its acquire deadline (its worker
died mid-acquire) is adopted when the provider has it healthy and ours, and destroyed
through the normal cleanup path otherwise."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from models.schema import LeaseState, RunStatus, utcnow
from models.store import NewLease
from providers.base import AcquireRequest, ManagedResource
from providers.faulty import FaultPlan
from providers.local import LocalProvider, ProcessIdentity, _alive
from providers.spec import SandboxSpec
from tasks import stuck
from tasks.stuck import StuckOutcome, stuck_provisioning
from tasks.sweeping import SweepContext, Tally, run_sweep
from tests.sweeps.conftest import Recorder, concurrently, events_to, set_lease
from workers.cli_status import sweep_ticks
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def half_acquired(rt: Runtime, run_id: str, created: bool = True, **spec: object) -> str:
    """What a worker killed mid-acquire leaves: the run, the intent and (maybe) the
    provider's resource, but no transition to active. Its acquire deadline has passed."""
    lease_id = uuid.uuid4().hex[:24]
    provider = rt.provider("local")
    rt.store.start_run(run_id, None, "local", f"key-{run_id}")
    rt.store.create_intent(NewLease(
        lease_id=lease_id, sandbox_key=f"key-{run_id}", provider="local",
        provider_lease_id=provider.lease_name(lease_id), reuse=False, tenant="acme",
        thread_id=None, run_id=run_id, spec={}, acquire_deadline_at=utcnow(),
        deadline_at=utcnow() + timedelta(hours=1), idle_timeout_s=60), None)
    if created:
        provider.acquire(AcquireRequest(
            lease_id=lease_id, name=provider.lease_name(lease_id),
            spec=SandboxSpec.model_validate(spec), labels={}, timeout_s=10))
    return lease_id


def test_healthy_resource_of_ours_is_adopted(rt: Runtime, effects: Recorder) -> None:
    lease_id = half_acquired(rt, "run-1")
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.ADOPTED] == 1 and effects.destroys == []
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.backend == "process"
    assert _alive(ProcessIdentity(lease.provider_meta["pid"], lease.provider_meta["start_ticks"]))
    assert lease.idle_deadline_at > utcnow() and lease.ready_at is not None
    assert events_to(rt, lease_id, LeaseState.ACTIVE, "adopted by sweep.stuck_provisioning") == 1
    assert rt.store.get_run("run-1").status == RunStatus.RUNNING


def test_one_lease_that_cannot_be_reconciled_does_not_hold_the_batch_back(
    rt: Runtime, effects: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle timeout no clock can add (10**12 s, stored on SQLite before specs were
    # bounded) made the adoption raise OverflowError, and the sweep stopped there, every
    # tick. Any such bug on one lease: here the same error, raised for that lease only.
    broken = half_acquired(rt, "run-broken")
    fine = half_acquired(rt, "run-fine")
    real_later = stuck.later

    def later(seconds: float) -> object:
        if seconds == 10**6:
            raise OverflowError("date value out of range")
        return real_later(seconds)

    set_lease(rt, broken, idle_timeout_s=10**6)
    monkeypatch.setattr(stuck, "later", later)
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.FAILED] == 1 and tally[StuckOutcome.ADOPTED] == 1, tally.items
    assert any(item.startswith(f"failed {broken} (OverflowError") for item in tally.items)
    assert rt.store.get_lease(fine).state == LeaseState.ACTIVE
    assert rt.store.get_lease(broken).state == LeaseState.PROVISIONING  # tried again later


def test_nothing_created_is_destroyed_through_cleanup_and_its_run_failed(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = half_acquired(rt, "run-1", created=False)
    effects.inline = True
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.DESTROY_ENQUEUED] == 1
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_stuck"
    assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "no resource under its name") == 1
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.FAILED and "acquire did not complete" in (run.error or "")


def test_unhealthy_resource_is_destroyed(rt: Runtime, effects: Recorder) -> None:
    lease_id = half_acquired(rt, "run-1", command=["sh", "-c", "exit 9"])


    deadline = time.monotonic() + 10
    while not any(r.exit_code is not None for r in rt.provider("local").list_managed()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    effects.inline = True
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.DESTROY_ENQUEUED] == 1
    assert "exited with code 9" in (rt.store.get_lease(lease_id).last_error or "")
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert rt.provider("local").list_managed() == []


def test_another_leases_resource_under_its_name_is_never_destroyed(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = half_acquired(rt, "run-1")
    record = Path(rt.settings.effective_local_root) / f"lk-{lease_id}" / "lease.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "lease_id": "someone-else"}))
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.CONFLICT] == 1 and effects.destroys == []
    assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    assert rt.provider("local").list_managed()[0].meta["alive"]


def test_deadline_is_inclusive_and_a_future_one_untouched(rt: Runtime, effects: Recorder) -> None:
    due = half_acquired(rt, "run-due")
    waiting = half_acquired(rt, "run-waiting")
    set_lease(rt, due, acquire_deadline_at=utcnow())
    set_lease(rt, waiting, acquire_deadline_at=utcnow() + timedelta(minutes=1))
    assert stuck_provisioning(SweepContext(rt, effects))[StuckOutcome.ADOPTED] == 1
    assert rt.store.get_lease(waiting).state == LeaseState.PROVISIONING


class AcquireFinishesFirst(LocalProvider):
    """The late acquire moves the lease to active while the sweep is listing."""

    lease_id = ""
    rt: Runtime | None = None

    def list_managed(self) -> list[ManagedResource]:
        assert self.rt is not None
        self.rt.store.transition(self.lease_id, {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                                 "ready (acquire)")
        return super().list_managed()


def test_the_acquire_finishing_first_wins(rt: Runtime, effects: Recorder) -> None:
    lease_id = half_acquired(rt, "run-1")
    racing = AcquireFinishesFirst(rt.settings.effective_local_root, "default", 2)
    racing.lease_id, racing.rt = lease_id, rt
    rt.put_provider(racing)
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.ACQUIRE_WON] == 1 and tally[StuckOutcome.ADOPTED] == 0
    assert events_to(rt, lease_id, LeaseState.ACTIVE) == 1


def test_overlapping_ticks_reconcile_each_lease_once(rt: Runtime, effects: Recorder) -> None:
    adopt = [half_acquired(rt, f"run-a{i}") for i in range(3)]
    drop = [half_acquired(rt, f"run-d{i}", created=False) for i in range(3)]
    tallies = concurrently([lambda: stuck_provisioning(SweepContext(rt, effects))] * 3)
    assert sum(t[StuckOutcome.ADOPTED] for t in tallies) == 3
    assert sum(t[StuckOutcome.DESTROY_ENQUEUED] for t in tallies) == 3
    assert sorted(lid for lid, _ in effects.destroys) == sorted(drop)
    for lease_id in adopt + drop:
        assert len([e for e in rt.store.events(lease_id)
                    if e.from_state == LeaseState.PROVISIONING]) == 1


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    adopt, drop = half_acquired(rt, "run-1"), half_acquired(rt, "run-2", created=False)
    tally = stuck_provisioning(SweepContext(rt, effects, dry_run=True))
    assert tally[StuckOutcome.ADOPTED] == 1 and tally[StuckOutcome.DESTROY_ENQUEUED] == 1
    for lease_id in (adopt, drop):
        assert rt.store.get_lease(lease_id).state == LeaseState.PROVISIONING
    assert effects.destroys == []


def test_a_retried_acquire_keeps_the_sweep_off_its_lease(
    rt: Runtime, effects: Recorder, faults: FaultPlan
) -> None:
    """A transient failure leaves the lease provisioning for the retry. When the retry (or
    a redelivery) comes after the first attempt's deadline, it moves the deadline before it
    works, so the sweep never adopts or destroys a lease an acquire is still working on."""
    from providers.errors import TransientProviderError
    from tasks.acquire import AcquireResult, acquire_lease

    faults.write({"acquire": [{"fault": "transient", "when": "before", "times": 2}]})
    spec = SandboxSpec(provider="faulty")
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", spec, None, may_retry=True)
    (lease,) = rt.store.leases()
    set_lease(rt, lease.lease_id, acquire_deadline_at=utcnow() - timedelta(seconds=1))
    with pytest.raises(TransientProviderError):  # the retry, late: still failing
        acquire_lease(rt, "run-1", spec, None, may_retry=True)
    assert rt.store.get_lease(lease.lease_id).acquire_deadline_at > utcnow()
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert sum(tally[outcome] for outcome in StuckOutcome) == 0 and effects.destroys == []
    done = acquire_lease(rt, "run-1", spec, None, may_retry=True)
    assert done.result == AcquireResult.ACQUIRED and done.lease_id == lease.lease_id
    assert rt.store.get_lease(lease.lease_id).state == LeaseState.ACTIVE


def test_extend_acquire_deadline_moves_only_a_provisioning_lease(rt: Runtime) -> None:
    lease_id = half_acquired(rt, "run-1", created=False)
    until = utcnow() + timedelta(minutes=5)
    assert rt.store.extend_acquire_deadline("run-1", until) == 1
    assert rt.store.get_lease(lease_id).acquire_deadline_at == until
    rt.store.transition(lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, "test")
    assert rt.store.extend_acquire_deadline("run-1", until + timedelta(minutes=5)) == 0
    assert rt.store.extend_acquire_deadline("no-such-run", until) == 0


def test_a_long_tick_counts_as_running_for_status_not_late(
        runtime_with: Callable[..., Runtime], effects: Recorder) -> None:
    # A tick that waits out stuck leases' readiness checks ran past three intervals, and
    # `leasekeeper status` said the sweep "has not run" while it worked.
    rt = runtime_with(stuck_provisioning_interval_s=0.05)
    client = rt.redis()

    def row() -> dict[str, Any]:
        return next(r for r in sweep_ticks(rt.settings, client) if r["sweep"] == stuck.NAME)

    run_sweep(stuck.NAME, stuck_provisioning, SweepContext(rt, effects))  # a tick ended
    time.sleep(0.2)  # then the next tick runs longer than three intervals
    seen: list[dict[str, Any]] = []

    def long_tick(ctx: SweepContext) -> Tally:
        while time.time() - (row()["last_tick_at"] or 0) <= 0.15:
            time.sleep(0.05)
        seen.append(row())  # what status says while the tick works
        return stuck_provisioning(ctx)

    run_sweep(stuck.NAME, long_tick, SweepContext(rt, effects))
    (during,) = seen
    assert not during["late"], during
    assert during.get("running_since") is not None, during
    after = row()  # the tick ended: judged by its end again, and no longer running
    assert not after["late"] and after.get("running_since") is None, after
