"""Every record tells the truth (issue 8), through the real broker and a real Celery worker
on SQLite and PostgreSQL: reuse never crosses providers, reclaim never takes a newer run's
sandbox, a possible leak is never reported as success, the messages at the retry cap say
what is true, and runs settle when their lease ends."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.errors import (
    CleanupAbandoned,
    InvalidRequest,
    ProviderError,
    ProviderMismatch,
    SandboxReclaimFailedError,
    TerminalProviderError,
)
from tasks import producer
from tests.e2e.conftest import eventually
from tests.stack import WorkerStack
from tests.sweeps.conftest import set_lease
from workers.app import app
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(180)


def rid(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def acquire(spec: dict[str, Any] | None = None, run_id: str | None = None) -> tuple[str, str]:
    run_id = run_id or rid()
    return run_id, producer.acquire_lease(run_id, spec or {}).get(60)["lease_id"]


def alive(rt: Runtime, lease_id: str) -> bool:
    pid = int(rt.store.get_lease(lease_id).provider_meta["pid"])
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][0] != "Z"


def reclaimed(rt: Runtime, run_id: str) -> Any:
    return eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                      60, f"the reclaim of {run_id}")


def lines_about(stack: WorkerStack, lease_id: str) -> list[str]:
    return [line for line in stack.logfile.read_text().splitlines() if lease_id in line]


# -- bug 2: reuse across providers -------------------------------------------------------
def test_reuse_refuses_another_providers_live_sandbox_and_touches_nothing(
    stack: WorkerStack,
) -> None:
    rt, key = stack.runtime(), f"shared-{uuid.uuid4().hex[:8]}"
    first, lease_id = acquire({"sandbox_key": key, "reuse": True, "thread_id": "th"})
    events = len(rt.store.events(lease_id))
    second = rid()
    with pytest.raises(ProviderMismatch, match="provider-mismatch") as err:
        producer.acquire_lease(second, {"provider": "faulty", "sandbox_key": key,
                                        "reuse": True, "thread_id": "th"}).get(60)
    assert isinstance(err.value, InvalidRequest)
    assert f"lease {lease_id}" in str(err.value) and "provider local" in str(err.value)
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.run_id == first
    assert len(rt.store.events(lease_id)) == events and alive(rt, lease_id)
    run = rt.store.get_run(second)
    assert run.status == RunStatus.FAILED and run.lease_id is None
    assert "provider-mismatch" in (run.error or "")
    assert rt.store.get_run(first).status == RunStatus.RUNNING
    producer.destroy_lease(lease_id).get(30)


# -- bug 3: reclaim by the run's own lease, every unfinished run counts -----------------
def test_reclaim_of_an_old_run_leaves_a_newer_paused_runs_sandbox_on_the_same_key(
    stack: WorkerStack,
) -> None:
    rt, key = stack.runtime(), f"key-{uuid.uuid4().hex[:8]}"
    old, old_lease = acquire({"sandbox_key": key})
    producer.finish_run(old, "completed", 0).get(30)
    assert reclaimed(rt, old).reclaim_outcome == ReclaimOutcome.DESTROYED
    new, new_lease = acquire({"sandbox_key": key})
    producer.finish_run(new, "interrupted").get(30)  # paused: its sandbox must stay
    again = producer.reclaim_run(old).get(30)  # a late, redelivered reclaim of the old run
    # it answers what it answered before (its own lease), and touches nothing else
    assert again["outcome"] == ReclaimOutcome.DESTROYED and again["lease_id"] == old_lease
    assert again["detail"] == "already reclaimed"
    assert rt.store.get_lease(new_lease).state == LeaseState.ACTIVE and alive(rt, new_lease)
    producer.destroy_lease(new_lease).get(30)


def test_reclaim_keeps_a_reused_sandbox_while_any_other_run_is_unfinished(
    stack: WorkerStack,
) -> None:
    rt, thread = stack.runtime(), f"th-{uuid.uuid4().hex[:8]}"
    first, lease_id = acquire({"thread_id": thread, "reuse": True})
    second, shared = acquire({"thread_id": thread, "reuse": True})
    assert shared == lease_id
    producer.finish_run(second, "interrupted").get(30)  # the newer run is paused
    producer.finish_run(first, "aborted").get(30)
    done = producer.reclaim_run(first).get(30)
    assert done["outcome"] == ReclaimOutcome.NOT_FOUND and second in done["detail"]
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE and alive(rt, lease_id)
    producer.destroy_lease(lease_id).get(30)


# -- bugs 4, 5, 6: abandoned leases, the retry cap, the final outcome --------------------
def test_abandoned_lease_is_reported_loudly_with_the_operator_command(
    stack: WorkerStack,
) -> None:
    rt = stack.runtime()
    stack.faults.write({"destroy": [{"fault": "terminal", "times": 3}]})
    run_id, lease_id = acquire({"provider": "faulty"})
    producer.finish_run(run_id, "completed", 0).get(30)  # its reclaim fails (attempt 1)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    with pytest.raises(TerminalProviderError):
        producer.destroy_lease(lease_id).get(30)  # attempt 2
    with pytest.raises(CleanupAbandoned) as capped:
        producer.destroy_lease(lease_id).get(30)  # attempt 3 of 3: abandoned
    assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    message = str(capped.value)
    assert "abandoned" in message and f"leasekeeper leases retry {lease_id}" in message
    assert "pending_cleanup" not in message and "will try again" not in message
    with pytest.raises(SandboxReclaimFailedError) as err:
        producer.reclaim_run(run_id).get(30)
    assert (err.value.run_id, err.value.lease_id) == (run_id, lease_id)
    assert err.value.sandbox_key == rt.store.get_run(run_id).sandbox_key
    assert "abandoned" in str(err.value) and f"leasekeeper leases retry {lease_id}" in str(
        err.value) and "will retry it" not in str(err.value)
    assert rt.store.get_run(run_id).reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    eventually(lambda: any("abandoned" in line for line in lines_about(stack, lease_id)),
               10, "the abandoned ERROR line")
    assert not [line for line in lines_about(stack, lease_id)
                if "will be retried" in line or "will try again" in line]
    stack.faults.write({})
    rt.store.transition(lease_id, {LeaseState.ABANDONED}, LeaseState.PENDING_CLEANUP, "test")
    producer.destroy_lease(lease_id).get(30)


def test_outcome_becomes_destroyed_once_the_retried_cleanup_succeeds(
    stack: WorkerStack,
) -> None:
    rt = stack.runtime()
    stack.faults.write({"destroy": [{"fault": "transient", "times": 1}]})
    run_id, lease_id = acquire({"provider": "faulty"})
    producer.finish_run(run_id, "completed", 0).get(30)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    eventually(lambda: app.send_task("sweep.retry_cleanup").get(30)
               and rt.store.get_lease(lease_id).state == LeaseState.DESTROYED,
               60, "the retried cleanup")
    assert rt.store.get_run(run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    reasons = [e.reason for e in rt.store.events(lease_id)]
    assert any("destroy attempt 1 failed" in r for r in reasons)  # the history is kept
    assert any(f"reclaim of run {run_id}: destroy-failed → destroyed" in r for r in reasons)
    lease = rt.store.get_lease(lease_id)
    assert lease.end_reason == f"reclaim of run {run_id}"  # not "retry cleanup"


def test_requested_destroy_keeps_its_end_reason_after_a_retry(stack: WorkerStack) -> None:
    rt = stack.runtime()
    stack.faults.write({"destroy": [{"fault": "transient", "times": 1}]})
    _, lease_id = acquire({"provider": "faulty"})
    with pytest.raises(ProviderError):
        producer.destroy_lease(lease_id, "user closed the tab").get(30)
    eventually(lambda: app.send_task("sweep.retry_cleanup").get(30)
               and rt.store.get_lease(lease_id).state == LeaseState.DESTROYED,
               60, "the retried cleanup")
    assert rt.store.get_lease(lease_id).end_reason == "user closed the tab"


def test_unexpected_exception_in_destroy_ends_in_a_recorded_state(stack: WorkerStack) -> None:
    rt = stack.runtime()
    stack.faults.write({"destroy": [{"fault": "value_error", "times": 1}]})
    _, lease_id = acquire({"provider": "faulty"})
    with pytest.raises(TerminalProviderError, match="ValueError") as err:
        producer.destroy_lease(lease_id).get(30)
    assert "malformed" in str(err.value)
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 1
    assert "ValueError" in (lease.last_error or "")
    producer.destroy_lease(lease_id).get(30)
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_unexpected_exception_in_reclaims_destroy_is_destroy_failed(stack: WorkerStack) -> None:
    rt = stack.runtime()
    stack.faults.write({"destroy": [{"fault": "value_error", "times": 1}]})
    run_id, lease_id = acquire({"provider": "faulty"})
    producer.finish_run(run_id, "failed", 1).get(30)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and "ValueError" in (lease.last_error or "")
    producer.destroy_lease(lease_id).get(30)
    assert rt.store.get_run(run_id).reclaim_outcome == ReclaimOutcome.DESTROYED


# -- runs never lie ----------------------------------------------------------------------
def test_a_lease_ending_by_idle_timeout_settles_its_run(stack: WorkerStack) -> None:
    rt = stack.runtime()
    run_id, lease_id = acquire()
    set_lease(rt, lease_id, idle_deadline_at=utcnow())
    app.send_task("sweep.expire_leases").get(30)
    eventually(lambda: rt.store.get_lease(lease_id).state == LeaseState.DESTROYED, 60,
               "the idle lease destroyed")
    run = rt.store.get_run(run_id)
    assert run.status == RunStatus.ABORTED and run.finished_at is not None
    assert run.error == f"its lease {lease_id} ended: idle"


def test_reap_runs_repairs_a_run_left_running_on_an_ended_lease(stack: WorkerStack) -> None:
    rt = stack.runtime()
    run_id, lease_id = acquire()
    producer.destroy_lease(lease_id).get(30)
    # As before this fix, or after a lost write: the lease ended, the run says running.
    from tests.sweeps.conftest import set_run

    set_run(rt, run_id, status=RunStatus.INTERRUPTED, finished_at=None, error=None)
    summary = app.send_task("sweep.reap_runs").get(30)
    assert f"settled {run_id}" in summary["items"]
    run = rt.store.get_run(run_id)
    assert run.status == RunStatus.ABORTED and run.error == f"its lease {lease_id} ended: requested"


def test_an_acquire_refused_after_its_run_was_recorded_fails_that_run(
        stack: WorkerStack) -> None:
    # Before: the run row stayed "running" with no lease, forever (the refusal came after
    # the run was written: a sandbox key another run's live lease holds, without reuse).
    rt = stack.runtime()
    key = f"sk-taken-{uuid.uuid4().hex[:8]}"
    _holder, held = acquire({"sandbox_key": key})
    run_id = rid()
    with pytest.raises(InvalidRequest, match="already has a live lease"):
        producer.acquire_lease(run_id, {"sandbox_key": key}).get(60)
    run = rt.store.get_run(run_id)
    assert run is not None and run.status == RunStatus.FAILED and run.lease_id is None
    assert run.finished_at is not None and "already has a live lease" in (run.error or "")
    assert not run.reclaim_due  # no sandbox was ever made for it
    assert rt.store.get_lease(held).state == LeaseState.ACTIVE  # the holder is untouched
    assert producer.destroy_lease(held).get(60)["state"] == "destroyed"  # leave no sandbox


def test_reap_runs_fails_a_run_whose_acquire_never_recorded_a_lease(
        stack: WorkerStack) -> None:
    # A run row written, then its acquire lost for good (a broker that lost the message,
    # or a store down when the acquire gave up): nothing would ever give it a lease.
    from models.invariants import Rule, check
    from tests.sweeps.conftest import set_run

    rt = stack.runtime()
    grace = rt.settings.leaseless_run_grace_s
    lost, recent = rid("lost"), rid("recent")
    for run_id in (lost, recent):
        rt.store.start_run(run_id, None, "local", f"sk-{run_id}")
    set_run(rt, lost, started_at=utcnow() - timedelta(seconds=grace + 5))
    # `leasekeeper check` names it; the recent one is an acquire still at work
    found = [v for v in check(rt.store, utcnow(), rt.settings.claim_timeout_s, None, grace)
             if v.rule == Rule.RUN_WITHOUT_LEASE]
    assert [v.run_id for v in found] == [lost]
    # `leasekeeper reap --dry-run` says what it would do and writes nothing
    from tasks.reap import reap_once

    (dry,) = reap_once(rt, dry_run=True, only=["sweep.reap_runs"])
    assert f"leaseless_failed {lost}" in dry["items"]
    assert rt.store.get_run(lost).status == RunStatus.RUNNING
    summary = app.send_task("sweep.reap_runs").get(30)
    assert f"leaseless_failed {lost}" in summary["items"]
    assert recent not in " ".join(summary["items"])
    failed, left = rt.store.get_run(lost), rt.store.get_run(recent)
    assert failed.status == RunStatus.FAILED and "never recorded a lease" in (failed.error or "")
    assert left.status == RunStatus.RUNNING
    # and an acquire that comes back for it late makes nothing
    with pytest.raises(InvalidRequest, match="is failed; start a new run"):
        producer.acquire_lease(lost, {}).get(60)
    assert check(rt.store, utcnow(), rt.settings.claim_timeout_s, None, grace) == []
