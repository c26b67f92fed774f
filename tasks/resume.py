"""``lease.resume_check``: can the run continue in its leased sandbox?

Expected states never raise: the answer is resumable (with details) or not resumable
(with the reason). A lease found not resumable is no longer live: it is marked
pending_cleanup and ``lease.destroy`` is enqueued, and the caller acquires a fresh one
(sandboxes such as Kubernetes pods cannot be restarted in place). When the provider says
why: the command exited (its exit code, or a Job's stop reason), the lease's runs are
finished with that exit in the same transaction, as sweep.finish_exited finishes them.
A resumable answer counts as activity and moves the idle deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from models.schema import LeaseState
from providers.base import ResumeOutcome, ResumeResult
from tasks.base import LeaseTask
from tasks.destroy import destroy
from tasks.leases import EXPIRED, expired, handle, later
from tasks.runs import exited_run
from workers.app import app
from workers.runtime import Runtime


@dataclass(frozen=True)
class ResumeCheck:
    lease_id: str
    outcome: ResumeOutcome
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    destroy_enqueued: bool = False
    destroy_reason: str = "not resumable"

    def as_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "outcome": str(self.outcome), "resumable":
                self.outcome == ResumeOutcome.RESUMABLE, "reason": self.reason,
                "details": self.details}


def check_lease(rt: Runtime, lease_id: str, task_id: str | None) -> ResumeCheck:
    lease = rt.store.get_lease(lease_id)
    if lease.state != LeaseState.ACTIVE:
        return ResumeCheck(lease_id, ResumeOutcome.NOT_RESUMABLE, f"lease is {lease.state}")
    if expired(lease):
        # Past its absolute deadline (ttl): sweep.expire_leases would end it at its next
        # tick; a run told "resumable" now would lose the sandbox under it. Ended here as
        # the sweep ends it (whatever the provider would say).
        reason = f"{EXPIRED} ({lease.deadline_at:%Y-%m-%dT%H:%M:%S}Z)"
        marked = rt.store.transition(
            lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP, reason, task_id,
            end_reason="expired", next_cleanup_at=later(rt.settings.claim_timeout_s))
        return ResumeCheck(lease_id, ResumeOutcome.NOT_RESUMABLE, reason,
                           destroy_enqueued=bool(marked), destroy_reason="expired")
    provider = rt.provider(lease.provider)
    result = provider.resume_check(handle(lease), rt.settings.resume_timeout_s)
    if result.outcome == ResumeOutcome.RESUMABLE:
        rt.store.touch(lease_id)
        return ResumeCheck(lease_id, result.outcome, "", result.details)
    moved = mark_not_resumable(rt, lease_id, result, task_id, "not_resumable",
                               later(rt.settings.claim_timeout_s))
    return ResumeCheck(lease_id, result.outcome, result.reason, destroy_enqueued=moved)


def mark_not_resumable(rt: Runtime, lease_id: str, result: ResumeResult, task_id: str | None,
                       end_reason: str, next_cleanup_at: datetime) -> bool:
    """Move the active lease to pending_cleanup (its destroy is the caller's); whether this
    caller moved it. If the provider says the command ended (an exit code, or a stop
    reason), its runs are finished with that exit in the same transaction, as
    sweep.finish_exited would finish them: the run's record does not depend on who noticed
    first. Otherwise they stay as they are, and the lease's end aborts them."""
    reason = f"not resumable: {result.reason}"
    if result.exited:
        return rt.store.move_ending_runs(
            lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP, reason, task_id,
            exited_run(result.exit_code, result.exit_reason), end_reason=end_reason,
            next_cleanup_at=next_cleanup_at)
    return rt.store.transition(
        lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP, reason, task_id,
        end_reason=end_reason, next_cleanup_at=next_cleanup_at) is not None


@app.task(bind=True, base=LeaseTask, name="lease.resume_check")
def resume_check(self: LeaseTask, lease_id: str) -> dict[str, Any]:
    with self.retrying():
        checked = check_lease(self.runtime, lease_id, self.request.id)
    if checked.destroy_enqueued:
        # The claim above holds until claim_timeout_s: if this enqueue is lost, the
        # retry sweep picks the lease up after that.
        destroy.apply_async(kwargs={"lease_id": lease_id, "reason": checked.destroy_reason})
    return checked.as_dict()

