"""The reaping sweeps celery beat runs: ``sweep.reap_runs``, ``sweep.expire_leases``,
``sweep.retry_cleanup``.

Every sweep does one bounded batch per tick, holds a single-flight lock in Redis (with an
expiry, so a dead sweep never blocks the next), claims rows in the store so overlapping
ticks, two beats or several workers never enqueue the same work twice, and returns a
summary of counts by outcome, which Flower shows as the task result. The effects are
lifecycle tasks (``lease.destroy``, ``sandbox.reclaim``) so each shows up in Flower too.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum

from models.schema import LeaseState, utcnow
from tasks.base import LeaseTask
from tasks.sweeping import Effects, Summary, Tally, sweep_task
from workers.app import app
from workers.runtime import Runtime


class ReapOutcome(StrEnum):
    ABORTED_DETACHED = "aborted_detached"  # detached past the TTL: aborted, reclaim sent
    RECLAIMS_ENQUEUED = "reclaims_enqueued"  # sandbox.reclaim sent (aborted ones included)


def reap_runs(rt: Runtime, effects: Effects, dry_run: bool) -> Tally:
    """Abort runs detached past the TTL (inclusive) and reclaim terminal runs' sandboxes."""
    s = rt.settings
    tally = Tally(ReapOutcome)
    now = utcnow()
    cutoff = now - timedelta(seconds=s.run_detach_ttl_s)
    aborted = rt.store.claim_detached_runs(cutoff, s.sweep_batch_size, s.claim_timeout_s)
    for run_id in aborted:
        tally.add(ReapOutcome.ABORTED_DETACHED, run_id)
    due = rt.store.claim_unreclaimed_runs(now, s.sweep_batch_size, s.claim_timeout_s)
    for run_id in [*aborted, *due]:
        effects.reclaim(run_id)
        tally.add(ReapOutcome.RECLAIMS_ENQUEUED, run_id)
    return tally


class ExpireOutcome(StrEnum):
    EXPIRED = "expired"  # past the absolute deadline: pending_cleanup, destroy sent
    IDLE = "idle"  # past the idle deadline: pending_cleanup, destroy sent


def expire_leases(rt: Runtime, effects: Effects, dry_run: bool) -> Tally:
    """Destroy active leases past their absolute deadline or idle past their timeout."""
    s = rt.settings
    tally = Tally(ExpireOutcome)
    for lease_id, kind in rt.store.due_expiries(utcnow(), s.sweep_batch_size):
        claimed = rt.store.transition(
            lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP,
            f"{kind}: past its {'absolute deadline' if kind == 'expired' else 'idle timeout'}",
            end_reason=kind, next_cleanup_at=utcnow() + timedelta(seconds=s.claim_timeout_s),
        )
        if claimed is not None:
            tally.add(ExpireOutcome(kind), lease_id)
            effects.destroy(lease_id, kind)
    return tally


class CleanupOutcome(StrEnum):
    RECOVERED_STALE_DESTROYS = "recovered_stale_destroys"
    DESTROYS_ENQUEUED = "destroys_enqueued"


def retry_cleanup(rt: Runtime, effects: Effects, dry_run: bool) -> Tally:
    """Destroy pending_cleanup leases again, oldest due first; recover dead destroy claims."""
    s = rt.settings
    tally = Tally(CleanupOutcome)
    now = utcnow()
    for lease_id in rt.store.stale_destroys(now, s.cleanup_batch_size, s.claim_timeout_s):
        if rt.store.transition(lease_id, {LeaseState.DESTROYING}, LeaseState.PENDING_CLEANUP,
                               "destroy claim expired (the worker died?)",
                               next_cleanup_at=now) is not None:
            tally.add(CleanupOutcome.RECOVERED_STALE_DESTROYS, lease_id)
    for lease_id in rt.store.claim_cleanups(now, s.cleanup_batch_size, s.claim_timeout_s):
        effects.destroy(lease_id, "retry cleanup")
        tally.add(CleanupOutcome.DESTROYS_ENQUEUED, lease_id)
    return tally


@app.task(bind=True, base=LeaseTask, name="sweep.reap_runs")
def reap_runs_task(self: LeaseTask) -> Summary:
    return sweep_task(self, "sweep.reap_runs", reap_runs)


@app.task(bind=True, base=LeaseTask, name="sweep.expire_leases")
def expire_leases_task(self: LeaseTask) -> Summary:
    return sweep_task(self, "sweep.expire_leases", expire_leases)


@app.task(bind=True, base=LeaseTask, name="sweep.retry_cleanup")
def retry_cleanup_task(self: LeaseTask) -> Summary:
    return sweep_task(self, "sweep.retry_cleanup", retry_cleanup)
