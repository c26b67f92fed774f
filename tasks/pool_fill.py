"""``sweep.fill_pools`` and ``pool.provision``: keep every warm pool at its size.

Each tick (beat, every ``LEASEKEEPER_FILL_POOLS_INTERVAL_S``, under the sweep's
single-flight lock) first drains, then fills:

- drain: warm members of a pool no longer declared, made from an older template, warm past
  the pool's ``max_age_s``, or beyond a shrunk pool's size go warm → pending_cleanup and
  get ``lease.destroy``, oldest first, at most ``LEASEKEEPER_SWEEP_BATCH_SIZE`` a tick;
- fill: for each declared pool, one guarded transaction under the pool's row lock counts
  its members and records new member intents (models/pool_store.py), then sends one
  ``pool.provision`` per member. The pool's circuit breaker stops creation after
  ``LEASEKEEPER_POOL_BREAKER_THRESHOLD`` consecutive failures, for a backoff that doubles
  with each further failure (reported as ``breaker_open``), then lets one probe member
  through at a time (``probing``) until one becomes ready and closes it. A template the
  provider refuses (its ``check_spec``: it can never run) is, where members were due, one
  failure on that breaker with the refusal as the pool's last error
  (``template_refused``), so `leasekeeper pools`, `status`, the metrics and the breaker's
  alert show it; once the template is accepted again, the breaker it opened closes.

``pool.provision`` (lease id only, on the pool lane, polled after every other lane)
creates one member through the provider's acquire, as an acquire would (the intent was
recorded first; a redelivery adopts what exists), with ``AcquireRequest.pool`` set, so the
member gets a run directory for its claim. Ready: provisioning → warm. Failed: the
failed-acquire path (pending_cleanup, then destroyed) and one failure on the breaker. A
member that never becomes ready stays provisioning (and counted) until
``sweep.stuck_provisioning`` takes it, so a pool whose sandboxes cannot start never
multiplies them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from models.pool_store import (
    LAST_ERROR_CHARS,
    TEMPLATE_REFUSED,
    Breaker,
    BreakerPolicy,
    BreakerState,
    DrainRule,
    FillDecision,
    FillTarget,
    PoolStore,
)
from models.schema import FINAL_STATES, LeaseState, utcnow
from providers.base import AcquireOutcome, AcquireRequest
from providers.errors import (
    AcquireCleanupIncomplete,
    InvalidRequest,
    ProviderError,
    TerminalProviderError,
    is_transient,
)
from providers.spec import SandboxSpec
from tasks.base import LeaseTask
from tasks.destroy import destroy_lease
from tasks.leases import later, new_lease_id
from tasks.sweeping import Summary, SweepContext, Tally, sweep_task
from workers.app import app
from workers.pool_settings import PoolDeclaration
from workers.runtime import Runtime
from workers.settings import Settings

NAME = "sweep.fill_pools"
POOL_LABEL = "leasekeeper.dev/pool"
log = logging.getLogger("leasekeeper.pools")


class FillOutcome(StrEnum):
    CREATED = "created"  # a member intent recorded and its pool.provision sent
    FULL = "full"  # a pool with its size in live members (provisioning or warm)
    AT_MAX_SIZE = "at_max_size"  # below size, but max_size members exist (some draining)
    BREAKER_OPEN = "breaker_open"  # a pool whose creates kept failing: nothing created
    PROBING = "probing"  # a pool whose breaker is half open: one probe member at a time
    TEMPLATE_REFUSED = "template_refused"  # the provider can never run the template: a failure
    EXPIRED = "expired"  # drained: warm past the pool's max_age_s
    EXCESS = "excess"  # drained: more members than the pool's (new) size
    REMOVED = "removed"  # drained: its pool is no longer declared
    STALE = "stale"  # drained: made from another template than the pool's current one
    NOT_CLAIMED = "not_claimed"  # a claim or another tick took the member first
    DEFERRED = "deferred"  # beyond this tick's batch of drains: next tick


def breaker_policy(settings: Settings) -> BreakerPolicy:
    return BreakerPolicy(settings.pool_breaker_threshold, settings.pool_breaker_backoff_s,
                         settings.pool_breaker_backoff_max_s)


def member_labels(rt: Runtime, lease_id: str, pool: str, spec: SandboxSpec) -> dict[str, str]:
    return {**spec.labels, "leasekeeper.dev/installation": rt.settings.installation_id,
            "leasekeeper.dev/lease-id": lease_id, "leasekeeper.dev/tenant": spec.tenant,
            POOL_LABEL: pool}


def fill_pools(ctx: SweepContext) -> Tally:
    tally = Tally(FillOutcome)
    pools = PoolStore(ctx.rt.store)
    _drain(ctx, pools, tally)
    for pool in ctx.rt.settings.pools:
        _fill(ctx, pools, pool, tally)
    return tally


def _drain(ctx: SweepContext, pools: PoolStore, tally: Tally) -> None:
    s = ctx.rt.settings
    rules = {p.name: DrainRule(p.size, p.member_spec().redacted()) for p in s.pools}
    due = pools.due_drains(rules, utcnow())
    batch, later_ones = due[:s.sweep_batch_size], due[s.sweep_batch_size:]
    for drain in later_ones:
        tally.add(FillOutcome.DEFERRED, drain.lease_id)
    won = batch if ctx.dry_run else pools.claim_drains(batch, s.claim_timeout_s, ctx.task_id)
    for _ in range(len(batch) - len(won)):
        tally.add(FillOutcome.NOT_CLAIMED)
    for drain in won:
        if not ctx.dry_run:
            ctx.effects.destroy(drain.lease_id, f"drained from pool {drain.pool}: {drain.kind}")
        tally.add(FillOutcome(drain.kind.value), drain.lease_id, drain.pool)


def _fill(ctx: SweepContext, pools: PoolStore, pool: PoolDeclaration, tally: Tally) -> None:
    rt = ctx.rt
    provider = rt.provider(pool.provider)
    spec = pool.member_spec()
    refused = None
    try:
        provider.check_spec(spec)
    except TerminalProviderError as exc:  # recorded on the pool's row as a fill failure
        refused = f"{TEMPLATE_REFUSED}: {exc}"[:LAST_ERROR_CHARS]
    target = FillTarget(
        pool=pool.name, size=pool.size, max_size=pool.max_size, batch=pool.fill_batch_size,
        provider=pool.provider, tenant=spec.tenant, spec=spec.redacted(),
        max_age_s=pool.max_age_s, acquire_timeout_s=rt.settings.acquire_timeout_s,
        idle_timeout_s=rt.settings.lease_idle_timeout_s, name_for=provider.lease_name,
        new_id=new_lease_id, refused=refused)
    filled = pools.fill(target, breaker_policy(rt.settings), ctx.task_id, ctx.dry_run)
    for lease_id in filled.lease_ids:
        ctx.effects.provision(lease_id)
    created = filled.lease_ids or [f"(new) in {pool.name}"] * filled.room  # a dry run's
    match filled.decision:
        case FillDecision.CREATED:
            for ident in created:
                tally.add(FillOutcome.CREATED, ident, pool.name)
        case FillDecision.PROBING:
            tally.add(FillOutcome.PROBING, pool.name,
                      ("one probe member created" if created else "its probe member is still "
                       "provisioning") + f"; {_breaker_detail(filled.breaker)}")
        case FillDecision.BREAKER_OPEN:
            tally.add(FillOutcome.BREAKER_OPEN, pool.name, _breaker_detail(filled.breaker))
        case FillDecision.REFUSED:
            detail = f"{(refused or '')[:200]}; {_failures_detail(filled.breaker)}"
            log.error("pool %s: its template cannot run on %s, fix it in LEASEKEEPER_POOLS "
                      "or LEASEKEEPER_POOLS_FILE: %s", pool.name, pool.provider, detail)
            tally.add(FillOutcome.TEMPLATE_REFUSED, pool.name, detail)
        case FillDecision.AT_MAX_SIZE:
            tally.add(FillOutcome.AT_MAX_SIZE, pool.name, _counts_detail(filled.counts))
        case FillDecision.FULL:
            tally.add(FillOutcome.FULL)


def _counts_detail(counts: dict[str, int]) -> str:
    return ", ".join(f"{state} {n}" for state, n in counts.items() if n) or "empty"


def _failures_detail(breaker: Breaker) -> str:
    until = (f", closed to creates until {breaker.open_until.isoformat(timespec='seconds')}Z"
             if breaker.open_until else "")
    return f"{breaker.consecutive_failures} consecutive failures{until}"


def _breaker_detail(breaker: Breaker) -> str:
    until = breaker.open_until.isoformat(timespec="seconds") + "Z" if breaker.open_until else "-"
    return (f"{breaker.consecutive_failures} consecutive failures, closed to creates until "
            f"{until}; last: {(breaker.last_error or '')[:120]}")


# -- pool.provision ------------------------------------------------------------------------
class ProvisionResult(StrEnum):
    WARM = "warm"  # created and ready: waiting for a claim
    ADOPTED = "adopted"  # an earlier attempt had created it: taken over, warm
    UNCHANGED = "unchanged"  # not a provisioning member any more (warm, claimed, ending)
    REMOVED = "removed"  # its pool is no longer declared: nothing created, cleaned up


@dataclass(frozen=True)
class Provisioned:
    lease_id: str
    result: ProvisionResult
    state: str

    def as_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "result": str(self.result),
                "state": str(self.state)}  # plain strings: see Acquisition.as_dict


def provision_member(rt: Runtime, lease_id: str, task_id: str | None, may_retry: bool
                     ) -> Provisioned:
    store, pools = rt.store, PoolStore(rt.store)
    lease = store.get_lease(lease_id)
    if lease.pool is None:
        raise InvalidRequest(f"lease {lease_id} is not a warm pool member; pool.provision "
                             "only creates members sweep.fill_pools recorded")
    if lease.state != LeaseState.PROVISIONING or lease.run_id is not None:
        return Provisioned(lease_id, ProvisionResult.UNCHANGED, lease.state)
    declared = {p.name: p for p in rt.settings.pools}.get(lease.pool)
    if declared is None:
        if store.transition(lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP,
                            f"pool {lease.pool} is no longer declared; not creating it",
                            task_id, end_reason="pool_removed", next_cleanup_at=utcnow()):
            destroy_lease(rt, lease_id, "pool removed", task_id)
        return Provisioned(lease_id, ProvisionResult.REMOVED, store.get_lease(lease_id).state)
    pools.extend_member_deadline(lease_id, later(rt.settings.acquire_timeout_s))
    spec = SandboxSpec.model_validate(lease.spec)
    provider = rt.provider(lease.provider)
    request = AcquireRequest(lease_id=lease_id, name=lease.provider_lease_id, spec=spec,
                             labels=member_labels(rt, lease_id, lease.pool, spec),
                             timeout_s=rt.settings.acquire_timeout_s, pool=lease.pool)
    try:
        acquired = provider.acquire(request)
    except ProviderError as exc:
        if is_transient(exc) and may_retry:
            raise  # the member stays provisioning (and counted); the retry adopts it
        _failed(rt, pools, lease.pool, lease_id, exc, task_id)
        raise
    result = (ProvisionResult.ADOPTED if acquired.outcome == AcquireOutcome.ADOPTED
              else ProvisionResult.WARM)
    if pools.member_ready(lease_id, lease.pool, acquired.backend, acquired.meta,
                          f"ready ({acquired.outcome}): warm in pool {lease.pool}", task_id,
                          breaker_policy(rt.settings)):
        return Provisioned(lease_id, result, LeaseState.WARM)
    # A sweep or a destroy took the member meanwhile: leave nothing we made behind.
    current = store.get_lease(lease_id)
    if current.state in FINAL_STATES and store.transition(
            lease_id, FINAL_STATES, LeaseState.PENDING_CLEANUP,
            "resources created after the member ended; destroying them", task_id,
            next_cleanup_at=utcnow(), backend=acquired.backend, provider_meta=acquired.meta):
        destroy_lease(rt, lease_id, "created after the member ended", task_id)
    return Provisioned(lease_id, ProvisionResult.UNCHANGED, store.get_lease(lease_id).state)


def _failed(rt: Runtime, pools: PoolStore, pool: str, lease_id: str, cause: ProviderError,
            task_id: str | None) -> None:
    """The failed-acquire path for a member: pending_cleanup with one failure on the pool's
    breaker (one transaction), then destroy what exists."""
    policy = breaker_policy(rt.settings)
    breaker = pools.member_failed(lease_id, pool, f"acquire failed: {cause}", str(cause),
                                  "acquire_failed", policy, utcnow(), task_id)
    if breaker is not None and breaker.state(policy.threshold, utcnow()) == BreakerState.OPEN:
        log.warning("pool %s: %d consecutive member creates failed; the pool creates nothing "
                    "until %sZ (then one probe at a time). Last error: %s", pool,
                    breaker.consecutive_failures, breaker.open_until, str(cause)[:300])
    done = destroy_lease(rt, lease_id, "pool member acquire failed", task_id)
    if done.error is not None:
        first = cause.__cause__ if isinstance(cause, AcquireCleanupIncomplete) else None
        raise AcquireCleanupIncomplete.of(lease_id, first or cause, done.error) from None


@app.task(bind=True, base=LeaseTask, name="pool.provision")
def provision(self: LeaseTask, lease_id: str) -> dict[str, Any]:
    rt = self.runtime

    def keep_provisioning(countdown_s: float) -> None:
        # The retry picks the member up again: its deadline covers the wait and the try.
        PoolStore(rt.store).extend_member_deadline(
            lease_id, later(countdown_s + rt.settings.acquire_timeout_s))

    with self.retrying(before_retry=keep_provisioning):
        done = provision_member(rt, lease_id, self.request.id, self.may_retry)
    return done.as_dict()


@app.task(bind=True, base=LeaseTask, name=NAME)
def fill_pools_task(self: LeaseTask) -> Summary:
    return sweep_task(self, NAME, fill_pools)
