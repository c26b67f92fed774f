"""``sweep.stuck_provisioning``: leases still provisioning past their acquire deadline.

A lease stays provisioning when the worker running its acquire died (or its message was
lost with the broker). Past the acquire deadline (inclusive), the sweep claims it (moving
the deadline one claim ahead, so no other tick takes it) and asks the provider:

- a resource under the lease's name, labelled with this lease, healthy (its resume check
  says resumable, its command has not exited) → adopted: active, with the backend and
  metadata from the provider's listing, the idle deadline starting now;
- nothing there, or not healthy → pending_cleanup (end_reason ``acquire_stuck``) and
  ``lease.destroy``, the normal path, so retries, backoff and the attempt cap apply; the
  run it was for is failed (as after a failed acquire);
- a resource under its name that another lease's label claims → abandoned for an operator
  (destroying it would destroy someone else's sandbox).

Warm pool members (tasks/pool_fill.py) are leases like any other here: an unclaimed member
(no run) found healthy is adopted back into its pool (warm); one whose sandbox exists but
is not healthy (it never became ready) is destroyed and counts as a failure on its pool's
circuit breaker. A member a run claimed but whose claim never completed (its worker died
between the claim and the activation), or a run's sandbox started cold from a pool's
template (its data, too, comes by a delivery), is never adopted (the run's data may not
have reached it): it is destroyed, and its run failed, as after a failed acquire.

If the acquire finishes first, its guarded transition wins and the sweep leaves it.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

from models.pool_store import PoolStore
from models.schema import Lease, LeaseState, RunStatus, utcnow
from providers.base import LeaseHandle, ManagedResource, ResumeOutcome
from providers.errors import ProviderError, is_transient
from tasks.base import LeaseTask
from tasks.leases import later
from tasks.pool_fill import breaker_policy
from tasks.sweeping import Listing, Summary, SweepContext, Tally, list_provider, sweep_task
from workers.app import app

NAME = "sweep.stuck_provisioning"
log = logging.getLogger("leasekeeper.sweeps")


class StuckOutcome(StrEnum):
    ADOPTED = "adopted"  # healthy and ours: active
    DESTROY_ENQUEUED = "destroy_enqueued"  # missing or unhealthy: pending_cleanup, destroy sent
    CONFLICT = "conflict"  # another lease's resource holds its name: abandoned for an operator
    ACQUIRE_WON = "acquire_won"  # its acquire finished (or gave up) before the sweep's write
    NOT_CLAIMED = "not_claimed"  # another tick claimed it first
    CHECK_FAILED = "check_failed"  # listing or resume check failed: retried after the claim
    FAILED = "failed"  # an unexpected error on this lease (logged): retried after the claim


def stuck_provisioning(ctx: SweepContext) -> Tally:
    rt, claims, tally = ctx.rt, ctx.claims, Tally(StuckOutcome)
    s, now = rt.settings, utcnow()
    due = claims.due_stuck(now, s.sweep_batch_size)
    if not due:
        return tally
    claimed = ({lease.lease_id for lease in due} if ctx.dry_run else
               set(claims.claim_stuck([lease.lease_id for lease in due], now, s.claim_timeout_s)))
    for _ in range(len(due) - len(claimed)):
        tally.add(StuckOutcome.NOT_CLAIMED)
    listings: dict[str, Listing] = {}
    for lease in due:
        if lease.lease_id not in claimed:
            continue
        if lease.provider not in listings:
            listings[lease.provider] = list_provider(rt, lease.provider)
        listing = listings[lease.provider]
        if listing.error is not None:
            tally.add(StuckOutcome.CHECK_FAILED, lease.lease_id, listing.error)
            continue
        resource = next((r for r in listing.resources if r.name == lease.provider_lease_id),
                        None)
        try:
            _reconcile(ctx, lease, resource, tally)
        except ProviderError as exc:  # an unexpected resume-check error: the claim expires
            tally.add(StuckOutcome.CHECK_FAILED, lease.lease_id, str(exc)[:200])
        except Exception as exc:
            if is_transient(exc):
                raise  # the store or the broker is away: the whole sweep is retried
            # One lease's bug must not hold the rest of the batch back: logged, and
            # tried again once its claim expires.
            log.exception("%s: lease %s could not be reconciled", NAME, lease.lease_id)
            tally.add(StuckOutcome.FAILED, lease.lease_id,
                      f"{type(exc).__name__}: {str(exc)[:200]}")
    return tally


def _reconcile(ctx: SweepContext, lease: Lease, resource: ManagedResource | None,
               tally: Tally) -> None:
    rt = ctx.rt
    if resource is not None and resource.lease_id not in (None, lease.lease_id):
        reason = (f"stuck provisioning: {resource.name} belongs to lease "
                  f"{resource.lease_id}; left for an operator")
        if ctx.dry_run or rt.store.transition(
                lease.lease_id, {LeaseState.PROVISIONING}, LeaseState.ABANDONED, reason,
                ctx.task_id, end_reason="acquire_conflict", last_error=reason,
                next_cleanup_at=None):
            tally.add(StuckOutcome.CONFLICT, lease.lease_id)
            if not ctx.dry_run:
                log.error("lease %s: %s", lease.lease_id, reason)
        else:
            tally.add(StuckOutcome.ACQUIRE_WON, lease.lease_id)
        return
    member = lease.pool is not None and lease.run_id is None  # an unclaimed pool member
    unhealthy = _unhealthy(ctx, lease, resource)
    if unhealthy is None and lease.claimed_at is not None:
        unhealthy = (f"its claim by run {lease.run_id} did not complete (the run's data may "
                     "not have reached it)")
    elif unhealthy is None and lease.pool is not None and lease.run_id is not None:
        unhealthy = (f"its start for run {lease.run_id} from pool {lease.pool}'s template did "
                     "not complete (the run's data may not have reached it)")
    if unhealthy is None and resource is not None:
        # An unclaimed member goes back to its pool; a run's lease becomes the run's.
        to = LeaseState.WARM if member else LeaseState.ACTIVE
        idle: dict[str, Any] = {} if member else {"idle_deadline_at": later(lease.idle_timeout_s)}
        if ctx.dry_run or rt.store.transition(
                lease.lease_id, {LeaseState.PROVISIONING}, to,
                f"adopted by {NAME}: the provider has it, healthy", ctx.task_id,
                backend=resource.backend, provider_meta=resource.meta, ready_at=utcnow(),
                **idle):
            tally.add(StuckOutcome.ADOPTED, lease.lease_id)
        else:
            tally.add(StuckOutcome.ACQUIRE_WON, lease.lease_id)
        return
    reason = f"stuck provisioning past its acquire deadline: {unhealthy}"
    if ctx.dry_run:
        tally.add(StuckOutcome.DESTROY_ENQUEUED, lease.lease_id, str(unhealthy))
        return
    found: dict[str, Any] = ({"backend": resource.backend, "provider_meta": resource.meta}
             if resource is not None else {})
    cleanup_at = later(rt.settings.claim_timeout_s)
    if member and lease.pool is not None and resource is not None:
        # It exists but never became ready: a failure of its pool's creates (#1215).
        moved = PoolStore(rt.store).member_failed(
            lease.lease_id, lease.pool, reason, reason, "acquire_stuck",
            breaker_policy(rt.settings), cleanup_at, ctx.task_id, **found) is not None
    else:
        moved = rt.store.transition(
            lease.lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP, reason,
            ctx.task_id, end_reason="acquire_stuck", last_error=reason,
            next_cleanup_at=cleanup_at, **found) is not None
    if not moved:
        tally.add(StuckOutcome.ACQUIRE_WON, lease.lease_id)
        return
    if lease.run_id:
        rt.store.finish_run(lease.run_id, RunStatus.FAILED, None,
                            f"acquire did not complete: {reason}", reclaim_due=False,
                            claim_until=None)
    ctx.effects.destroy(lease.lease_id, "stuck provisioning")
    tally.add(StuckOutcome.DESTROY_ENQUEUED, lease.lease_id, str(unhealthy))


def _unhealthy(ctx: SweepContext, lease: Lease, resource: ManagedResource | None) -> str | None:
    """Why the lease's resource cannot be adopted, or None if it is healthy."""
    if resource is None:
        return "the provider has no resource under its name"
    if resource.exit_code is not None:
        return f"its command already exited with code {resource.exit_code}"
    provider = ctx.rt.provider(lease.provider)
    check = provider.resume_check(LeaseHandle(resource.name, resource.backend, resource.meta),
                                  ctx.rt.settings.resume_timeout_s)
    return None if check.outcome == ResumeOutcome.RESUMABLE else check.reason or "not resumable"


@app.task(bind=True, base=LeaseTask, name=NAME)
def stuck_provisioning_task(self: LeaseTask) -> Summary:
    return sweep_task(self, NAME, stuck_provisioning)
