"""The reaping sweeps celery beat runs: ``sweep.reap_runs``, ``sweep.expire_leases``,
``sweep.retry_cleanup``.

Every sweep does one bounded batch per tick, holds a single-flight lock in Redis (with an
expiry, so a dead sweep never blocks the next), claims rows in the store so overlapping
ticks, two beats or several workers never enqueue the same work twice, and returns a
summary of counts by outcome, which Flower shows as the task result. The effects are
lifecycle tasks (``lease.destroy``, ``sandbox.reclaim``) so each shows up in Flower too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import redis

from models.schema import LeaseState, utcnow
from providers.errors import StoreUnavailable
from tasks.base import LeaseTask
from tasks.destroy import destroy
from tasks.reclaim import reclaim
from workers.app import app
from workers.runtime import Runtime

log = logging.getLogger("leasekeeper.sweeps")
Summary = dict[str, Any]


@contextlib.contextmanager
def single_flight(rt: Runtime, sweep: str, ttl_s: float) -> Iterator[bool]:
    """Hold the sweep's Redis lock while the body runs; yield False if another holds it."""
    lock = rt.redis().lock(f"leasekeeper:sweep:{sweep}", timeout=max(ttl_s, 1.0),
                           blocking=False)
    try:
        acquired = bool(lock.acquire(blocking=False))
    except redis.RedisError as exc:
        raise StoreUnavailable(f"Redis lock for {sweep} unavailable: {exc}") from None
    try:
        yield acquired
    finally:
        if acquired:
            with contextlib.suppress(redis.RedisError):
                lock.release()


def reap_runs(rt: Runtime, enqueue: Callable[[str], None]) -> Summary:
    """Abort runs detached past the TTL (inclusive) and reclaim terminal runs' sandboxes."""
    s = rt.settings
    now = utcnow()
    cutoff = now - timedelta(seconds=s.run_detach_ttl_s)
    aborted = rt.store.claim_detached_runs(cutoff, s.sweep_batch_size, s.claim_timeout_s)
    for run_id in aborted:
        enqueue(run_id)
    due = rt.store.claim_unreclaimed_runs(now, s.sweep_batch_size, s.claim_timeout_s)
    for run_id in due:
        enqueue(run_id)
    return {"aborted_detached": len(aborted), "reclaims_enqueued": len(aborted) + len(due)}


def expire_leases(rt: Runtime, enqueue: Callable[[str, str], None]) -> Summary:
    """Destroy active leases past their absolute deadline or idle past their timeout."""
    s = rt.settings
    counts = {"expired": 0, "idle": 0}
    for lease_id, kind in rt.store.due_expiries(utcnow(), s.sweep_batch_size):
        claimed = rt.store.transition(
            lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP,
            f"{kind}: past its {'absolute deadline' if kind == 'expired' else 'idle timeout'}",
            end_reason=kind, next_cleanup_at=utcnow() + timedelta(seconds=s.claim_timeout_s),
        )
        if claimed is not None:
            counts[kind] += 1
            enqueue(lease_id, kind)
    return counts


def retry_cleanup(rt: Runtime, enqueue: Callable[[str, str], None]) -> Summary:
    """Destroy pending_cleanup leases again, oldest due first; recover dead destroy claims."""
    s = rt.settings
    now = utcnow()
    recovered = 0
    for lease_id in rt.store.stale_destroys(now, s.cleanup_batch_size, s.claim_timeout_s):
        if rt.store.transition(lease_id, {LeaseState.DESTROYING}, LeaseState.PENDING_CLEANUP,
                               "destroy claim expired (the worker died?)",
                               next_cleanup_at=now) is not None:
            recovered += 1
    claimed = rt.store.claim_cleanups(now, s.cleanup_batch_size, s.claim_timeout_s)
    for lease_id in claimed:
        enqueue(lease_id, "retry cleanup")
    return {"recovered_stale_destroys": recovered, "destroys_enqueued": len(claimed)}


def _run_sweep(task: LeaseTask, name: str, body: Callable[[Runtime], Summary]) -> Summary:
    rt = task.runtime
    with task.retrying(), single_flight(rt, name, rt.settings.claim_timeout_s) as mine:
        if not mine:
            return {"sweep": name, "skipped": "another tick holds the lock"}
        summary = {"sweep": name, **body(rt)}
    log.info("%s: %s", name, summary)
    return summary


def _enqueue_reclaim(run_id: str) -> None:
    reclaim.apply_async(kwargs={"run_id": run_id})


def _enqueue_destroy(lease_id: str, reason: str) -> None:
    destroy.apply_async(kwargs={"lease_id": lease_id, "reason": reason})


@app.task(bind=True, base=LeaseTask, name="sweep.reap_runs")
def reap_runs_task(self: LeaseTask) -> Summary:
    return _run_sweep(self, "sweep.reap_runs", lambda rt: reap_runs(rt, _enqueue_reclaim))


@app.task(bind=True, base=LeaseTask, name="sweep.expire_leases")
def expire_leases_task(self: LeaseTask) -> Summary:
    return _run_sweep(self, "sweep.expire_leases",
                      lambda rt: expire_leases(rt, _enqueue_destroy))


@app.task(bind=True, base=LeaseTask, name="sweep.retry_cleanup")
def retry_cleanup_task(self: LeaseTask) -> Summary:
    return _run_sweep(self, "sweep.retry_cleanup",
                      lambda rt: retry_cleanup(rt, _enqueue_destroy))
