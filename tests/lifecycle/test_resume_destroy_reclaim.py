"""resume_check, destroy and reclaim: every outcome the seeds name, on real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus
from models.store import RunChange
from providers.base import ResumeOutcome
from providers.errors import InvalidRequest, NotFound, SandboxReclaimFailedError
from providers.faulty import FaultPlan
from providers.local import _group_members
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.destroy import DestroyResult, destroy_lease
from tasks.leases import handle
from tasks.reclaim import reclaim_run
from tasks.resume import check_lease
from tasks.runs import finish
from tests.e2e.conftest import eventually, until_gone
from workers.runtime import Runtime


def acquire(rt: Runtime, run_id: str = "run-1", **spec: object) -> str:
    return acquire_lease(rt, run_id, SandboxSpec.model_validate(spec), None, False).lease_id


def pid_of(rt: Runtime, lease_id: str) -> int:
    return int(rt.store.get_lease(lease_id).provider_meta["pid"])


# -- resume check --------------------------------------------------------------------
def test_live_sandbox_is_resumable_and_the_check_counts_as_activity(rt: Runtime) -> None:
    lease_id = acquire(rt)
    before = rt.store.get_lease(lease_id).idle_deadline_at
    time.sleep(0.01)
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.RESUMABLE
    assert checked.details["pid"] == pid_of(rt, lease_id)
    assert rt.store.get_lease(lease_id).idle_deadline_at > before


def test_exited_sandbox_is_not_resumable_and_is_marked_for_cleanup(rt: Runtime) -> None:
    lease_id = acquire(rt, command=["sh", "-c", "exit 7"])
    until_gone(rt, "local", lease_id, "the command to exit")
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.NOT_RESUMABLE
    assert checked.reason.endswith("exited with exit code 7") and checked.destroy_enqueued
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.end_reason == "not_resumable"


def test_killed_sandbox_is_not_resumable(rt: Runtime) -> None:
    lease_id = acquire(rt)
    os.killpg(pid_of(rt, lease_id), signal.SIGKILL)
    # kill() returns before the process is gone: wait until it is, however busy the host
    eventually(lambda: not _group_members(pid_of(rt, lease_id)), 10, "the sandbox to die")
    assert check_lease(rt, lease_id, None).reason.startswith(f"process {pid_of(rt, lease_id)}")


def test_reused_pid_is_not_mistaken_for_the_sandbox(rt: Runtime) -> None:
    lease_id = acquire(rt)
    lease = rt.store.get_lease(lease_id)
    record = Path(lease.provider_meta["workspace"]) / "lease.json"
    import json

    data = json.loads(record.read_text())
    data["start_ticks"] -= 1  # as if another process now had this pid
    record.write_text(json.dumps(data))
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.NOT_RESUMABLE and "pid was reused" in checked.reason


def test_workspace_gone_is_not_resumable(rt: Runtime) -> None:
    lease_id = acquire(rt)
    lease = rt.store.get_lease(lease_id)
    destroy_lease_directly = rt.provider("local")

    destroy_lease_directly.destroy(handle(lease))
    assert check_lease(rt, lease_id, None).reason == "workspace no longer exists"


def test_ended_lease_is_not_resumable_without_asking_the_provider(rt: Runtime) -> None:
    lease_id = acquire(rt)
    destroy_lease(rt, lease_id, "test", None)
    assert check_lease(rt, lease_id, None).reason == "lease is destroyed"


def test_unexpected_provider_errors_propagate(rt: Runtime, faults: FaultPlan) -> None:
    lease_id = acquire(rt, provider="faulty")
    faults.write({"resume_check": [{"fault": "terminal", "times": 1}]})
    with pytest.raises(Exception, match="injected terminal"):
        check_lease(rt, lease_id, None)
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE


# -- destroy --------------------------------------------------------------------------
def test_destroy_kills_the_group_and_is_idempotent(rt: Runtime) -> None:
    lease_id = acquire(rt, command=["sh", "-c", "sleep 300 & sleep 300"])
    pid = pid_of(rt, lease_id)
    assert destroy_lease(rt, lease_id, "done", None).result == DestroyResult.DESTROYED
    assert _group_members(pid) == []  # no member of the group is left
    assert destroy_lease(rt, lease_id, "again", None).result == DestroyResult.ALREADY_ENDED
    assert rt.provider("local").list_managed() == []


def test_destroy_of_a_term_ignoring_sandbox_escalates_to_sigkill(rt: Runtime) -> None:
    lease_id = acquire(rt, command=["sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
    # The destroy must come after the shell ignores TERM (a destroy right after the spawn
    # can beat the trap and end it at once): wait until /proc says SIGTERM is ignored.
    _wait_until_ignores_sigterm(pid_of(rt, lease_id))
    started = time.monotonic()
    assert destroy_lease(rt, lease_id, "done", None).result == DestroyResult.DESTROYED
    assert time.monotonic() - started >= rt.settings.local_destroy_grace_s * 0.9


def _wait_until_ignores_sigterm(pgid: int, timeout_s: float = 30.0) -> None:
    """Until a process of the sandbox's group (the user's shell, under the launcher)
    has SIGTERM in its ignored set."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _group_members(pgid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            ignored = int(next(line.split()[1] for line in status.splitlines()
                               if line.startswith("SigIgn:")), 16)
            if ignored & (1 << (signal.SIGTERM - 1)):
                return
        time.sleep(0.01)
    raise AssertionError(f"no process of group {pgid} ignored SIGTERM within {timeout_s}s")


def test_destroy_of_an_already_gone_sandbox_is_success(rt: Runtime) -> None:
    lease_id = acquire(rt)

    rt.provider("local").destroy(handle(rt.store.get_lease(lease_id)))
    assert destroy_lease(rt, lease_id, "x", None).result == DestroyResult.DESTROYED
    assert "already_gone" in rt.store.events(lease_id)[-1].reason


def test_failed_destroy_keeps_the_lease_and_counts_to_abandoned(
    rt: Runtime, faults: FaultPlan
) -> None:
    lease_id = acquire(rt, provider="faulty")
    faults.write({"destroy": [{"fault": "terminal", "times": 3}]})
    results = [destroy_lease(rt, lease_id, "x", None).result for _ in range(3)]
    assert results == [DestroyResult.CLEANUP_PENDING, DestroyResult.CLEANUP_PENDING,
                       DestroyResult.ABANDONED]
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.ABANDONED and lease.cleanup_attempts == 3
    assert "injected terminal" in (lease.last_error or "")


def test_destroy_of_unknown_lease_is_not_found(rt: Runtime) -> None:
    with pytest.raises(NotFound, match="no lease 'nope'"):
        destroy_lease(rt, "nope", "x", None)


# -- reclaim --------------------------------------------------------------------------
def test_reclaim_destroys_the_sandbox_of_a_finished_run(rt: Runtime) -> None:
    lease_id = acquire(rt)
    change, due = finish(rt, "run-1", RunStatus.COMPLETED, 0, None)
    assert change == RunChange.CHANGED and due
    assert reclaim_run(rt, "run-1", None).outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    run = rt.store.get_run("run-1")
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED and run.reclaimed_at is not None
    # A repeated reclaim is a no-op: the same answer, and the recorded outcome is kept
    # (it used to answer not-found and overwrite `destroyed` with it).
    again = reclaim_run(rt, "run-1", None)
    assert (again.outcome, again.detail) == (ReclaimOutcome.DESTROYED, "already reclaimed")
    after = rt.store.get_run("run-1")
    assert after.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert after.reclaimed_at == run.reclaimed_at


def test_reclaim_without_sandbox_key(rt: Runtime) -> None:
    rt.store.start_run("run-9", None, "local", "k")
    from sqlalchemy import update

    from models.schema import Run

    with rt.store.tx() as s:
        s.execute(update(Run).where(Run.run_id == "run-9").values(sandbox_key=None))
    finish(rt, "run-9", RunStatus.FAILED, 1, None)
    assert reclaim_run(rt, "run-9", None).outcome == ReclaimOutcome.NO_SANDBOX_KEY


def test_reclaim_refuses_a_lease_of_another_provider_and_touches_nothing(rt: Runtime) -> None:
    lease_id = acquire(rt, sandbox_key="shared-key")
    rt.store.start_run("run-2", None, "noop", "shared-key")
    from sqlalchemy import update

    from models.schema import Run

    with rt.store.tx() as s:  # bound across providers (as reuse did before its provider gate)
        s.execute(update(Run).where(Run.run_id == "run-2").values(lease_id=lease_id))
    finish(rt, "run-2", RunStatus.COMPLETED, 0, None)
    events_before = len(rt.store.events(lease_id))
    assert reclaim_run(rt, "run-2", None).outcome == ReclaimOutcome.PROVIDER_MISMATCH
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.ACTIVE and len(rt.store.events(lease_id)) == events_before


def test_reclaim_destroy_failure_keeps_the_lease_reachable_and_fails_loudly(
    rt: Runtime, faults: FaultPlan
) -> None:
    lease_id = acquire(rt, provider="faulty")
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)
    faults.write({"destroy": [{"fault": "transient", "times": 1}]})
    with pytest.raises(SandboxReclaimFailedError, match='run "run-1" failed'):
        reclaim_run(rt, "run-1", None)
    lease = rt.store.get_lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP  # not resumable, still reachable
    assert check_lease(rt, lease_id, None).outcome == ResumeOutcome.NOT_RESUMABLE
    assert rt.store.get_run("run-1").reclaim_outcome == ReclaimOutcome.DESTROY_FAILED
    assert len(rt.provider("faulty").list_managed()) == 1


def test_reclaim_of_a_running_run_is_refused(rt: Runtime) -> None:
    acquire(rt)
    with pytest.raises(InvalidRequest, match="finish it"):
        reclaim_run(rt, "run-1", None)


def test_reused_sandbox_is_not_reclaimed_from_under_a_newer_run(rt: Runtime) -> None:
    spec = {"thread_id": "th", "reuse": True}
    lease_id = acquire(rt, "run-1", **spec)
    acquire(rt, "run-2", **spec)
    change, due = finish(rt, "run-1", RunStatus.ABORTED, None, None)
    assert change == RunChange.CHANGED and not due  # reused sandboxes outlive their runs
    assert reclaim_run(rt, "run-1", None).outcome == ReclaimOutcome.NOT_FOUND
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE


def test_destroy_kills_children_that_outlived_the_command(rt: Runtime) -> None:
    lease_id = acquire(rt, command=["sh", "-c", "sleep 300 & exit 0"])
    pid = pid_of(rt, lease_id)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid in _group_members(pid):
        time.sleep(0.02)  # the command itself exits; its background child stays
    assert _group_members(pid), "the background child should still be running"
    destroy_lease(rt, lease_id, "done", None)
    assert _group_members(pid) == []
