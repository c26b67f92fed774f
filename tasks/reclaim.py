"""``sandbox.reclaim``: tear down the sandbox behind a terminal run.

Follows the seed's outcomes and orderings: no sandbox key → ``no-sandbox-key``; no tracked
lease for the key → ``not-found``; the lease belongs to another provider → refused
(``provider-mismatch``), touching nothing, not even the lease. Otherwise destroy. Where
the seed deletes its only pointer even when destroy failed, we keep it: the lease becomes
pending_cleanup (no longer resumable, still reachable by ``sweep.retry_cleanup``), the run
records ``destroy-failed``, and the task fails with SandboxReclaimFailedError.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from models.schema import TERMINAL_RUN_STATUSES, ReclaimOutcome, RunStatus
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
        return {"run_id": self.run_id, "outcome": self.outcome, "lease_id": self.lease_id,
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
    lease = store.tracked_lease_for_key(run.sandbox_key)
    if lease is None:
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND))
    if lease.provider != run.provider:
        log.warning("reclaim: lease %s belongs to provider %s, run %s to %s; refusing",
                    lease.lease_id, lease.provider, run_id, run.provider)
        return _record(rt, Reclaimed(run_id, ReclaimOutcome.PROVIDER_MISMATCH, lease.lease_id,
                                     f"lease provider {lease.provider}"))
    if lease.run_id not in (None, run_id):
        current = store.get_run(lease.run_id)
        if current is not None and current.status == RunStatus.RUNNING:
            # A reused sandbox now serves a newer run of the thread: not ours to destroy.
            return _record(rt, Reclaimed(run_id, ReclaimOutcome.NOT_FOUND, lease.lease_id,
                                         f"sandbox now serves run {lease.run_id}"))
    done = destroy_lease(rt, lease.lease_id, f"reclaim of run {run_id}", task_id)
    if done.result == DestroyResult.IN_PROGRESS:
        raise TransientProviderError(f"lease {lease.lease_id} is being destroyed; retrying")
    if done.error is not None:
        _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROY_FAILED, lease.lease_id))
        log.error("reclaim: destroy failed for run %s; lease %s is %s and will be retried",
                  run_id, lease.lease_id, done.state)
        raise SandboxReclaimFailedError.of(run_id, run.sandbox_key, lease.lease_id,
                                           str(done.error))
    return _record(rt, Reclaimed(run_id, ReclaimOutcome.DESTROYED, lease.lease_id))


def _record(rt: Runtime, reclaimed: Reclaimed) -> Reclaimed:
    rt.store.record_reclaim(reclaimed.run_id, reclaimed.outcome)
    log.info("reclaim: run %s %s", reclaimed.run_id, reclaimed.outcome)
    return reclaimed


@app.task(bind=True, base=LeaseTask, name="sandbox.reclaim")
def reclaim(self: LeaseTask, run_id: str) -> dict[str, Any]:
    with self.retrying():
        return reclaim_run(self.runtime, run_id, self.request.id).as_dict()
