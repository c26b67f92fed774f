"""``sandbox.reclaim``: tear down the sandbox behind a terminal run.

Follows the seed's outcomes and orderings. The lease is the run's own (``run.lease_id``),
never one found by sandbox key: a newer run may hold the key now. No sandbox key →
``no-sandbox-key``; the run never got a lease, or its lease is already destroyed →
``not-found``; the lease belongs to another provider → refused (``provider-mismatch``),
touching nothing, not even the lease; another run bound to the lease is not finished
(running, or interrupted: paused, it still needs the sandbox) → ``not-found``, the sandbox
is not ours to take, and so is one a run of the thread reuses between that check and the
destroy's claim (the claim is guarded on the lease's run). Otherwise destroy.

A possible leak is never reported as success. Where the seed deletes its only pointer
even when destroy failed, we keep it: the lease becomes pending_cleanup (no longer
resumable, still reachable by ``sweep.retry_cleanup``), the run records
``destroy-failed``, and the task fails with SandboxReclaimFailedError. A lease that is
abandoned (before reclaim read it, between the read and the claim, or by this very
destroy reaching the attempt cap) is ``destroy-failed`` too, and the error and the ERROR
log line say it waits for an operator and which command to run. Once a later destroy
succeeds, the run's outcome becomes ``destroyed`` (models/store.py); the failures stay in
the lease's history.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from models.schema import TERMINAL_RUN_STATUSES, LeaseState, ReclaimOutcome
from providers.errors import (
    InvalidRequest,
    NotFound,
    SandboxReclaimFailedError,
    TransientProviderError,
)
from tasks.base import LeaseTask
from tasks.destroy import DestroyResult, destroy_lease
from workers.app import app
from workers.runtime import Runtime

log = logging.getLogger("leasekeeper.reclaim")


@dataclass(frozen=True)
class Reclaimed:
    run_id: str
    outcome: ReclaimOutcome
    lease_id: str | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "outcome": str(self.outcome), "lease_id": self.lease_id,
                "detail": self.detail}


def reclaim_run(rt: Runtime, run_id: str, task_id: str | None) -> Reclaimed:
    store = rt.store
    run = store.get_run(run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r} in the store; nothing to reclaim")
    if run.status not in TERMINAL_RUN_STATUSES:
        raise InvalidRequest(
            f"run {run_id} is {run.status}; finish it (run.finish) before reclaiming"
        )
    if run.sandbox_key is None:
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.NO_SANDBOX_KEY))
    # NOT guarded: a store failure here means we do not know what to destroy; it propagates.
    lease = store.find_lease(run.lease_id) if run.lease_id else None
    if lease is None:
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND, run.lease_id,
                                     "the run has no lease" if run.lease_id is None
                                     else "its lease row is gone"))
    if lease.provider != run.provider:
        log.warning("reclaim: lease %s belongs to provider %s, run %s to %s; refusing",
                    lease.lease_id, lease.provider, run_id, run.provider)
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.PROVIDER_MISMATCH, lease.lease_id,
                                     f"lease provider {lease.provider}"))
    if lease.state == LeaseState.DESTROYED and run.reclaim_outcome == ReclaimOutcome.DESTROYED:
        # A repeated or redelivered reclaim: same answer, nothing written.
        return Reclaimed(run_id, ReclaimOutcome.DESTROYED, lease.lease_id, "already reclaimed")
    if lease.state == LeaseState.DESTROYED:
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND, lease.lease_id,
                                     "its lease is already destroyed"))
    if lease.state == LeaseState.ABANDONED:
        return _abandoned(rt, run_id, run.sandbox_key, lease.lease_id)
    in_use = store.other_unfinished_runs(lease.lease_id, run_id)
    if in_use:
        # A reused sandbox still serves another run of the thread: not ours to destroy.
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND, lease.lease_id,
                                     f"sandbox still serves run {', '.join(in_use)}"))
    # Only while no other run took the lease since it was read (a reuse binds it to its
    # run): one that did between the check above and the claim keeps its sandbox.
    done = destroy_lease(rt, lease.lease_id, f"reclaim of run {run_id}", task_id,
                         bound_to=lease.run_id)
    match done.result:
        case DestroyResult.REBOUND:
            in_use = store.other_unfinished_runs(lease.lease_id, run_id)
            if in_use:
                return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND, lease.lease_id,
                                             f"sandbox still serves run {', '.join(in_use)}"))
            raise TransientProviderError(f"lease {lease.lease_id} was bound to another run "
                                         "while it was being reclaimed; retrying")
        case DestroyResult.IN_PROGRESS:
            raise TransientProviderError(f"lease {lease.lease_id} is being destroyed; retrying")
        case DestroyResult.DESTROYED:
            return _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROYED, lease.lease_id))
        case DestroyResult.ALREADY_ENDED if done.state == LeaseState.DESTROYED:
            return _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROYED, lease.lease_id,
                                         "destroyed by another task meanwhile"))
        case DestroyResult.ALREADY_ENDED | DestroyResult.ABANDONED:
            # Abandoned between our read and our claim, or by this attempt at the cap.
            return _abandoned(rt, run_id, run.sandbox_key, lease.lease_id)
        case DestroyResult.CLEANUP_PENDING:
            recorded = _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROY_FAILED,
                                             lease.lease_id))
            if recorded.outcome == ReclaimOutcome.DESTROYED:
                return recorded
            log.error("reclaim: destroy failed for run %s; the sandbox may still be running. "
                      "Lease %s is pending_cleanup and sweep.retry_cleanup will retry it: %s",
                      run_id, lease.lease_id, done.error)
            raise SandboxReclaimFailedError.of(run_id, run.sandbox_key, lease.lease_id,
                                               str(done.error))


def _abandoned(rt: Runtime, run_id: str, sandbox_key: str, lease_id: str) -> Reclaimed:
    """The run's lease is abandoned: a possible leak, reported as one, never as success."""
    cause = rt.store.get_lease(lease_id).last_error or "its cleanup gave up"
    recorded = _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROY_FAILED, lease_id,
                                     "lease abandoned"))
    if recorded.outcome == ReclaimOutcome.DESTROYED:
        return recorded
    error = SandboxReclaimFailedError.of(run_id, sandbox_key, lease_id, cause, abandoned=True)
    log.error("reclaim: run %s: %s", run_id, error)
    raise error


def _record(rt: Runtime, reclaimed: Reclaimed) -> Reclaimed:
    """Record the outcome; what was recorded: a destroy-failed whose lease another task
    destroyed meanwhile is destroyed (Store.record_reclaim)."""
    recorded = ReclaimOutcome(rt.store.record_reclaim(reclaimed.run_id, reclaimed.outcome))
    if recorded != reclaimed.outcome:
        reclaimed = Reclaimed(reclaimed.run_id, recorded, reclaimed.lease_id,
                              "destroyed by another task meanwhile")
    log.info("reclaim: run %s %s", reclaimed.run_id, reclaimed.outcome)
    return reclaimed


@app.task(bind=True, base=LeaseTask, name="sandbox.reclaim")
def reclaim(self: LeaseTask, run_id: str) -> dict[str, Any]:
    with self.retrying():
        return reclaim_run(self.runtime, run_id, self.request.id).as_dict()
