"""``sweep.orphans``: provider resources no lease accounts for are recorded and destroyed.

Every enabled provider lists the resources carrying this installation's label. Each one
is matched to its lease row (by its name, or the lease id its label carries):

- a live or cleaning-up lease accounts for it: left alone (``tracked``);
- an abandoned lease: left for the operator, who retries or forgets it;
- no lease row at all (its record was deleted, or it was made outside leasekeeper under
  our label): once older than ``orphan_grace_s`` it is recorded as a lease row,
  pending_cleanup with end_reason ``orphan`` and the provider's name, backend and metadata,
  and ``lease.destroy`` is sent, so retries, backoff, the attempt cap and the event history
  apply to it like to any lease;
- a destroyed lease whose resource is still listed after the destroy was recorded (it came
  back, or an operator forgot a lease that was never removed): pending_cleanup again, with
  the backend and metadata the listing reports now, the destroy that did not take counted
  as an attempt, so one that keeps coming back ends
  abandoned and counted rather than looping.

Young resources (an acquire may be in flight), resources the provider reports as already
terminating, and resources of unknown age are never touched. Except one terminating past
the provider's limit (``stuck_terminating``: its deletion began long ago and has not
finished, e.g. a stuck garbage collector keeping a Job's pods running): it is reported,
logged, and handled like an orphan past its grace (recorded or revived, and destroyed
again, which deletes its pods explicitly), unless a live lease still accounts for it.
Recording is the claim: of two overlapping ticks only one inserts (or revives) the row and
sends its destroy.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from enum import StrEnum

from models.schema import FINAL_STATES, LeaseState, utcnow
from models.sweep_store import Orphan
from providers.base import ManagedResource
from tasks.base import LeaseTask
from tasks.sweeping import (
    Listing,
    Summary,
    SweepContext,
    Tally,
    list_providers,
    naive_utc,
    sweep_task,
)
from workers.app import app

NAME = "sweep.orphans"
log = logging.getLogger("leasekeeper.sweeps")


class OrphanOutcome(StrEnum):
    RECORDED = "recorded"  # no lease row: recorded pending_cleanup (orphan), destroy sent
    REVIVED = "revived"  # destroyed, yet still there: pending_cleanup again, destroy sent
    ABANDONED = "abandoned"  # it kept coming back until the attempt cap: for an operator
    TRACKED = "tracked"  # a live or cleaning-up lease accounts for it
    LEFT_FOR_OPERATOR = "left_for_operator"  # its lease is abandoned: the operator decides
    WITHIN_GRACE = "within_grace"  # younger than orphan_grace_s: an acquire may be in flight
    TERMINATING = "terminating"  # the provider is already deleting it
    # terminating past the provider's limit; also counted under what was done with it
    STUCK_TERMINATING = "stuck_terminating"
    AGE_UNKNOWN = "age_unknown"  # no creation time: never destroyed on a guess
    NOT_CLAIMED = "not_claimed"  # another tick recorded or revived it first
    DEFERRED = "deferred"  # beyond this tick's batch: next tick
    LIST_FAILED = "list_failed"  # a provider could not list its resources: next tick


def orphans(ctx: SweepContext) -> Tally:
    tally = Tally(OrphanOutcome)
    budget = ctx.rt.settings.orphan_batch_size
    for listing in list_providers(ctx.rt):
        if listing.error is not None:
            tally.add(OrphanOutcome.LIST_FAILED, listing.provider, listing.error)
            continue
        budget = _sweep_listing(ctx, listing, tally, budget)
    return tally


def _sweep_listing(ctx: SweepContext, listing: Listing, tally: Tally, budget: int) -> int:
    s = ctx.rt.settings
    index = ctx.claims.leases_for(listing.provider, [r.name for r in listing.resources],
                                  [r.lease_id for r in listing.resources if r.lease_id])
    old_enough = listing.listed_at - timedelta(seconds=s.orphan_grace_s)
    for resource in sorted(listing.resources, key=lambda r: (r.created_at is None, r.name)):
        lease = index.lookup(resource.name, resource.lease_id)
        stuck = bool(resource.meta.get("stuck_terminating"))
        if stuck:
            _report_stuck(listing, resource, tally)
        if lease is not None and lease.state not in FINAL_STATES:
            tally.add(OrphanOutcome.TRACKED)
            continue
        if lease is not None and lease.state == LeaseState.ABANDONED:
            tally.add(OrphanOutcome.LEFT_FOR_OPERATOR, lease.lease_id)
            continue
        if not stuck:  # a stuck deletion began past the limit: its age no longer matters
            if resource.meta.get("terminating"):
                tally.add(OrphanOutcome.TERMINATING, resource.name)
                continue
            if resource.created_at is None:
                tally.add(OrphanOutcome.AGE_UNKNOWN, resource.name)
                continue
            if naive_utc(resource.created_at) > old_enough:  # inclusive: the grace is old
                tally.add(OrphanOutcome.WITHIN_GRACE, resource.name)
                continue
        if budget == 0:
            tally.add(OrphanOutcome.DEFERRED, resource.name)
            continue
        budget -= 1
        if lease is not None:
            _revive(ctx, listing, resource, lease.lease_id, tally)
        else:
            _record(ctx, listing, resource, tally)
    return budget


def _report_stuck(listing: Listing, resource: ManagedResource, tally: Tally) -> None:
    since = resource.meta.get("terminating_since") or "?"
    log.warning("%s %s (lease %s) is still terminating, its deletion began %s: past the "
                "provider's terminating limit (is its garbage collection stuck?); a destroy "
                "deletes its pods explicitly", listing.provider, resource.name,
                resource.lease_id or "unknown", since)
    tally.add(OrphanOutcome.STUCK_TERMINATING, resource.name, f"terminating since {since}")


def _record(ctx: SweepContext, listing: Listing, resource: ManagedResource,
            tally: Tally) -> None:
    tenant = resource.meta.get("tenant")
    orphan = Orphan(
        provider=listing.provider, name=resource.name, backend=resource.backend,
        lease_id=resource.lease_id, meta=dict(resource.meta),
        tenant=tenant if isinstance(tenant, str) and tenant else "unknown",
        reason=(f"orphan: {listing.provider} lists {resource.name} (created "
                f"{naive_utc(resource.created_at).isoformat() if resource.created_at else '?'}"
                "Z) and no lease in the store accounts for it; recorded for cleanup"),
    )
    if ctx.dry_run:
        tally.add(OrphanOutcome.RECORDED, orphan.row_id, f"{listing.provider} {resource.name}")
        return
    s = ctx.rt.settings
    lease_id = ctx.claims.record_orphan(orphan, utcnow(), s.claim_timeout_s, ctx.task_id)
    if lease_id is None:
        tally.add(OrphanOutcome.NOT_CLAIMED, orphan.row_id)
        return
    log.warning("orphan %s %s recorded as lease %s; destroying it", listing.provider,
                resource.name, lease_id)
    ctx.effects.destroy(lease_id, "orphan")
    tally.add(OrphanOutcome.RECORDED, lease_id, f"{listing.provider} {resource.name}")


def _revive(ctx: SweepContext, listing: Listing, resource: ManagedResource, lease_id: str,
            tally: Tally) -> None:
    if ctx.dry_run:
        tally.add(OrphanOutcome.REVIVED, lease_id, f"{listing.provider} {resource.name}")
        return
    s = ctx.rt.settings
    moved = ctx.claims.revive(
        lease_id, listing.listed_at,
        f"orphan: {listing.provider} still lists {resource.name} after its destroy was "
        "recorded; cleaning up again", utcnow(), s.claim_timeout_s, s.cleanup_max_attempts,
        ctx.task_id, found={"backend": resource.backend, "provider_meta": dict(resource.meta)})
    if moved is None:  # destroyed after we listed, or another tick revived it
        tally.add(OrphanOutcome.NOT_CLAIMED, lease_id)
    elif moved == LeaseState.ABANDONED:
        log.error("lease %s: %s %s keeps coming back after its destroy; abandoned for an "
                  "operator (`leasekeeper leases show %s`)", lease_id, listing.provider,
                  resource.name, lease_id)
        tally.add(OrphanOutcome.ABANDONED, lease_id)
    else:
        log.warning("lease %s: %s %s still exists after its destroy; destroying it again",
                    lease_id, listing.provider, resource.name)
        ctx.effects.destroy(lease_id, "orphan: still present after its destroy")
        tally.add(OrphanOutcome.REVIVED, lease_id, f"{listing.provider} {resource.name}")


@app.task(bind=True, base=LeaseTask, name=NAME)
def orphans_task(self: LeaseTask) -> Summary:
    return sweep_task(self, NAME, orphans)
