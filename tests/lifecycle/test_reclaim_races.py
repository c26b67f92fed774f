"""Reclaim when another worker changes the lease between reclaim's read and its claim, and
every lease end settling its runs, on SQLite and PostgreSQL with real local sandboxes.

The race needs "the other worker" to act exactly between two store calls of one task: a
Store whose destroy claim first lets a given change happen (the one seam faked here; the
database, the provider and the task logic are real)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus
from models.store import Store
from providers.errors import SandboxReclaimFailedError
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.destroy import destroy_lease
from tasks.reclaim import reclaim_run
from tasks.runs import finish
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


class RacingStore(Store):
    """Runs ``meanwhile`` once, just before the first claim of a destroy."""

    def __init__(self, url: str, meanwhile: Callable[[Store], Any]) -> None:
        super().__init__(url)
        self.meanwhile: Callable[[Store], Any] | None = meanwhile

    def claim_to_destroy(self, lease_id: str, expected: Any, reason: str,
                         task_id: str | None, first_end_reason: str,
                         bound_to: str | None = None) -> Any:
        if self.meanwhile is not None:
            act, self.meanwhile = self.meanwhile, None
            act(self)
        return super().claim_to_destroy(lease_id, expected, reason, task_id, first_end_reason,
                                        bound_to)


def racing(rt: Runtime, meanwhile: Callable[[Store], Any]) -> Runtime:
    return Runtime(settings=rt.settings, store=RacingStore(rt.store.url, meanwhile),
                   _providers=rt._providers)


def finished_run(rt: Runtime) -> str:
    lease_id = acquire_lease(rt, "run-1", SandboxSpec(), None, False).lease_id
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)
    return lease_id


def test_lease_abandoned_between_read_and_claim_is_destroy_failed(rt: Runtime) -> None:
    lease_id = finished_run(rt)

    def abandon(store: Store) -> None:  # an operator's or a sweep's change, just in time
        store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.ABANDONED, "as if",
                         last_error="gave up")

    with pytest.raises(SandboxReclaimFailedError, match="abandoned") as err:
        reclaim_run(racing(rt, abandon), "run-1", None)
    assert (err.value.run_id, err.value.lease_id) == ("run-1", lease_id)
    assert f"leasekeeper leases retry {lease_id}" in str(err.value)
    assert rt.store.get_run("run-1").reclaim_outcome == ReclaimOutcome.DESTROY_FAILED


def test_lease_destroyed_by_another_task_between_read_and_claim_is_destroyed(
    rt: Runtime,
) -> None:
    lease_id = finished_run(rt)
    done = reclaim_run(racing(rt, lambda _store: destroy_lease(rt, lease_id, "other", None)),
                       "run-1", None)
    assert done.outcome == ReclaimOutcome.DESTROYED and "another task" in done.detail
    assert rt.provider("local").list_managed() == []


def test_abandonment_settles_the_runs_on_the_lease(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th", reuse=True, provider="faulty")
    lease_id = acquire_lease(rt, "run-1", spec, None, False).lease_id
    acquire_lease(rt, "run-2", spec, None, False)
    finish(rt, "run-2", RunStatus.INTERRUPTED, None, None)
    from providers.faulty import FaultPlan

    assert rt.settings.faults_file is not None
    FaultPlan(rt.settings.faults_file).write({"destroy": [{"fault": "terminal", "times": 3}]})
    for _ in range(rt.settings.cleanup_max_attempts):
        destroy_lease(rt, lease_id, "x", None)
    assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    for run_id in ("run-1", "run-2"):
        run = rt.store.get_run(run_id)
        assert run.status == RunStatus.ABORTED and run.error == f"its lease {lease_id} ended: x"
    FaultPlan(rt.settings.faults_file).write({})


def test_reuse_bound_between_read_and_claim_keeps_the_sandbox(rt: Runtime) -> None:
    # run-1 finished; its reclaim has found no other run on the lease when run-2 of the
    # same thread reuses the sandbox (resume-checked, bound) before the destroy's claim:
    # the sandbox now serves run-2 and is not reclaim's to destroy.
    spec = SandboxSpec(thread_id="th", reuse=True)
    lease_id = acquire_lease(rt, "run-1", spec, None, False).lease_id
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)

    def reuse(_store: Store) -> None:
        reused = acquire_lease(rt, "run-2", spec, None, False)
        assert (reused.result, reused.lease_id) == ("reused", lease_id)

    done = reclaim_run(racing(rt, reuse), "run-1", None)
    assert done.outcome == ReclaimOutcome.NOT_FOUND
    assert done.detail == "sandbox still serves run run-2"
    lease = rt.store.get_lease(lease_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, "run-2")
    assert rt.store.get_run("run-2").status == RunStatus.RUNNING
    assert [r.name for r in rt.provider("local").list_managed()] == [lease.provider_lease_id]
    # once run-2 is done too, its own reclaim takes the sandbox
    finish(rt, "run-2", RunStatus.COMPLETED, 0, None)
    assert reclaim_run(rt, "run-2", None).outcome == ReclaimOutcome.DESTROYED
    assert rt.provider("local").list_managed() == []
