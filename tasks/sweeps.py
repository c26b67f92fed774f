"""The store-driven sweeps celery beat runs: ``sweep.reap_runs``, ``sweep.expire_leases``,
``sweep.retry_cleanup``. (Provider-driven ones: finish_exited.py, stuck.py, orphans.py.)

Each tick handles one bounded batch: it reads what is due (models/sweep_store.py), then
claims exactly those rows again with every condition re-checked, so overlapping ticks,
two beats or several workers never do the same work twice; the machinery in sweeping.py
adds the Redis single-flight lock and the summary Flower shows. The effects are lifecycle
tasks (``lease.destroy``, ``sandbox.reclaim``), so each shows up in Flower on its own.

Activity, for ``sweep.expire_leases``: only ``lease.touch`` (the producer's
``touch_lease``), a resumable ``lease.resume_check`` and a reuse of the sandbox by a new
run of its thread move a lease's idle deadline. Nothing else does: traffic inside a
sandbox never keeps it alive. The absolute deadline never moves.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from enum import StrEnum

from models.schema import LeaseState, utcnow
from tasks.base import LeaseTask
from tasks.sweeping import Summary, SweepContext, Tally, sweep_task
from workers.app import app

log = logging.getLogger("leasekeeper.sweeps")


class ReapOutcome(StrEnum):
    ABORTED_DETACHED = "aborted_detached"  # detached past the TTL: aborted, cancel recorded
    RECLAIMS_ENQUEUED = "reclaims_enqueued"  # sandbox.reclaim sent (aborted ones included)
    NOT_CLAIMED = "not_claimed"  # the viewer came back, or another tick won the claim
    SETTLED = "settled"  # still running/interrupted on an ended lease: aborted with its reason
    LEASELESS_FAILED = "leaseless_failed"  # its acquire never recorded a lease: failed


def reap_runs(ctx: SweepContext) -> Tally:
    """Abort runs detached past the TTL (inclusive cutoff) and reclaim their sandboxes;
    re-send the reclaim of terminal runs whose reclaim was lost; settle runs left
    unfinished on an ended lease; fail runs whose acquire never recorded a lease."""
    s, claims, tally = ctx.rt.settings, ctx.claims, Tally(ReapOutcome)
    now = utcnow()
    cutoff = now - timedelta(seconds=s.run_detach_ttl_s)
    detached = claims.due_detached_runs(cutoff, s.sweep_batch_size)
    lost = claims.due_reclaims(now, s.sweep_batch_size)
    if ctx.dry_run:
        for run_id in detached:
            tally.add(ReapOutcome.ABORTED_DETACHED, run_id)
        for run_id in lost:
            tally.add(ReapOutcome.RECLAIMS_ENQUEUED, run_id)
        settle_runs(ctx, tally)
        fail_leaseless_runs(ctx, tally)
        return tally
    aborted = claims.claim_detached_runs(detached, cutoff, s.claim_timeout_s)
    for _ in range(len(detached) - len(aborted)):
        tally.add(ReapOutcome.NOT_CLAIMED)
    due = [run_id for run_id, reclaim_due in aborted if reclaim_due]
    for run_id, _due in aborted:
        tally.add(ReapOutcome.ABORTED_DETACHED, run_id)
    reclaims = claims.claim_reclaims(lost, now, s.claim_timeout_s)
    for _ in range(len(lost) - len(reclaims)):
        tally.add(ReapOutcome.NOT_CLAIMED)
    for run_id in [*due, *reclaims]:
        ctx.effects.reclaim(run_id)
        tally.add(ReapOutcome.RECLAIMS_ENQUEUED, run_id)
    settle_runs(ctx, tally)
    fail_leaseless_runs(ctx, tally)
    return tally


def fail_leaseless_runs(ctx: SweepContext, tally: Tally) -> None:
    """Fail runs running with no lease for longer than any acquire can be alive without
    recording one (settings.leaseless_run_grace_s): an acquire that gave up fails its run
    itself (tasks/acquire.py), this catches a lost message or a store that was down then.
    No sandbox exists for them (a lease is recorded before anything is created)."""
    cutoff = utcnow() - timedelta(seconds=ctx.rt.settings.leaseless_run_grace_s)
    due = ctx.claims.due_leaseless_runs(cutoff, ctx.rt.settings.sweep_batch_size)
    failed = due if ctx.dry_run else ctx.claims.fail_leaseless_runs(due, cutoff)
    for _ in range(len(due) - len(failed)):
        tally.add(ReapOutcome.NOT_CLAIMED)
    for run_id in failed:
        tally.add(ReapOutcome.LEASELESS_FAILED, run_id)


def settle_runs(ctx: SweepContext, tally: Tally) -> None:
    """Repair runs that say running or interrupted while their lease has ended: every
    lease end settles its runs (models/store.py), this catches any it did not."""
    claims = ctx.claims
    due = claims.due_runs_on_ended_leases(ctx.rt.settings.sweep_batch_size)
    settled = due if ctx.dry_run else claims.settle_runs_on_ended_leases(due)
    for _ in range(len(due) - len(settled)):
        tally.add(ReapOutcome.NOT_CLAIMED)
    for run_id in settled:
        tally.add(ReapOutcome.SETTLED, run_id)


class ExpireOutcome(StrEnum):
    EXPIRED = "expired"  # past the absolute deadline: pending_cleanup, destroy sent
    IDLE = "idle"  # past the idle deadline: pending_cleanup, destroy sent
    NOT_CLAIMED = "not_claimed"  # touched meanwhile, or another tick won the claim


def expire_leases(ctx: SweepContext) -> Tally:
    """Destroy active leases at or past their absolute deadline or idle deadline."""
    s, claims, tally = ctx.rt.settings, ctx.claims, Tally(ExpireOutcome)
    now = utcnow()
    due = claims.due_expiries(now, s.sweep_batch_size)
    if ctx.dry_run:
        for item in due:
            tally.add(ExpireOutcome(item.kind), item.lease_id)
        return tally
    claimed = claims.claim_expiries([d.lease_id for d in due], now, s.claim_timeout_s,
                                    ctx.task_id)
    for _ in range(len(due) - len(claimed)):
        tally.add(ExpireOutcome.NOT_CLAIMED)
    for item in claimed:
        tally.add(ExpireOutcome(item.kind), item.lease_id)
        ctx.effects.destroy(item.lease_id, item.kind)
    return tally


class CleanupOutcome(StrEnum):
    RECOVERED_STALE_DESTROYS = "recovered_stale_destroys"  # worker died mid-destroy: due again
    ABANDONED = "abandoned"  # that stale destroy was the last allowed attempt
    DESTROYS_ENQUEUED = "destroys_enqueued"  # lease.destroy sent for a due pending_cleanup
    NOT_CLAIMED = "not_claimed"  # another tick (or a destroy) took it first
    ABANDONED_TOTAL = "abandoned_total"  # gauge: leases waiting for an operator right now


def retry_cleanup(ctx: SweepContext) -> Tally:
    """Destroy pending_cleanup leases again, oldest lease first, each attempt once its
    backoff has passed (lease.destroy counts attempts and abandons at the cap); recover
    destroys whose worker died, counting them as failed attempts."""
    s, claims, tally = ctx.rt.settings, ctx.claims, Tally(CleanupOutcome)
    now = utcnow()
    stale = claims.due_stale_destroys(now, s.cleanup_batch_size, s.claim_timeout_s)
    if ctx.dry_run:
        for lease_id in stale:
            tally.add(CleanupOutcome.RECOVERED_STALE_DESTROYS, lease_id)
    else:
        moved = claims.recover_stale_destroys(stale, now, s.claim_timeout_s,
                                              s.cleanup_max_attempts, ctx.task_id)
        for lease_id, state in moved:
            if state == LeaseState.ABANDONED:
                tally.add(CleanupOutcome.ABANDONED, lease_id)
                log.error("lease %s abandoned: its last allowed destroy died with its worker; "
                          "run `leasekeeper leases retry %s` to try again", lease_id, lease_id)
            else:
                tally.add(CleanupOutcome.RECOVERED_STALE_DESTROYS, lease_id)
    due = claims.due_cleanups(utcnow(), s.cleanup_batch_size)
    if ctx.dry_run:
        for lease_id in due:
            tally.add(CleanupOutcome.DESTROYS_ENQUEUED, lease_id)
    else:
        claimed = claims.claim_cleanups(due, utcnow(), s.claim_timeout_s)
        for _ in range(len(due) - len(claimed)):
            tally.add(CleanupOutcome.NOT_CLAIMED)
        for lease_id in claimed:
            ctx.effects.destroy(lease_id, "retry cleanup")
            tally.add(CleanupOutcome.DESTROYS_ENQUEUED, lease_id)
    tally.counts[CleanupOutcome.ABANDONED_TOTAL.value] = claims.count_in_state(
        LeaseState.ABANDONED)
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
