"""The claim steps of ``lease.acquire`` for a spec naming a warm pool (tasks/acquire.py
runs them in order, after the run row and a reuse attempt):

1. ``take``: ONE guarded statement makes the pool's oldest warm member the run's
   (provisioning, ``claimed_at`` set, the run's key, tenant, redacted spec and deadlines:
   ``deadline_at`` is now plus the run's TTL, so expiry sees an adopted member like any
   lease), with its event and the run's binding, in one transaction
   (models/pool_store.py); None when the pool has no warm member: a cold start follows;
2. ``deliver``: the provider's claim: a cheap resume check, then the run's env,
   secret_env, labels and tenant into the member's run directory (idempotent: a
   redelivered acquire delivers again);
3. ``activate``: provisioning → active with the idle deadline starting now; or, for a
   member that was not resumable, ``discard``: pending_cleanup, the run unbound from it
   (one transaction), destroyed, and the next member is tried.

A worker killed between 1 and 3 leaves a provisioning lease bound to the run, which the
acquire's redelivery finishes, or ``sweep.stuck_provisioning`` cleans up (a claimed member
is never adopted half-delivered).
"""

from __future__ import annotations

from models.pool_store import ClaimIntent, PoolStore
from models.schema import AnyLease, LeaseRecord, utcnow
from providers.base import Claimed, ClaimRequest, LeaseHandle, Provider
from providers.spec import SandboxSpec
from tasks.destroy import destroy_lease
from tasks.leases import later
from workers.runtime import Runtime

CLAIMED_REASON = "claimed from pool"  # the start of a claimed member's activation event


def take(rt: Runtime, spec: SandboxSpec, sandbox_key: str, run_id: str, task_id: str | None,
         bound_lease: str | None = None) -> LeaseRecord | None:
    """The pool's oldest warm member, now the run's; None if the pool has none warm.
    Raises LiveLeaseExists if the run's sandbox key already has a live lease, RunRebound
    if the run was bound to a lease other than ``bound_lease`` (the one it had when the
    acquire read it) meanwhile."""
    assert spec.pool is not None
    s = rt.settings
    return PoolStore(rt.store).claim(ClaimIntent(
        pool=spec.pool, run_id=run_id, sandbox_key=sandbox_key, tenant=spec.tenant,
        thread_id=spec.thread_id, reuse=spec.reuse, spec=spec.redacted(),
        acquire_deadline_at=later(s.acquire_timeout_s),
        deadline_at=later(spec.ttl_s or s.lease_ttl_s),
        idle_timeout_s=spec.idle_timeout_s or s.lease_idle_timeout_s,
        bound_lease=bound_lease), task_id)


def deliver(rt: Runtime, provider: Provider, target: LeaseHandle, lease_id: str, run_id: str,
            spec: SandboxSpec, labels: dict[str, str]) -> Claimed:
    """The provider's claim of the sandbox at ``target`` (a member, or a cold start made
    from its pool's template) for the run: resume check, then the run's data."""
    return provider.claim(target, ClaimRequest(
        lease_id=lease_id, run_id=run_id, tenant=spec.tenant, labels=labels,
        env=dict(spec.env), secret_env=spec.secret_values(),
        timeout_s=rt.settings.resume_timeout_s))


def activate(rt: Runtime, member: AnyLease, claimed: Claimed, run_id: str, task_id: str | None
             ) -> bool:
    """provisioning → active for the run; False if something else took the lease meanwhile."""
    return PoolStore(rt.store).activate(
        member.lease_id, run_id, {**(member.provider_meta or {}), **claimed.meta},
        later(member.idle_timeout_s),
        f"{CLAIMED_REASON} {member.pool} by run {run_id}: its data delivered", task_id)


def discard(rt: Runtime, member: AnyLease, run_id: str, why: str, task_id: str | None) -> bool:
    """A claimed member that was not resumable: pending_cleanup and no longer the run's, in
    one transaction, then destroyed here, as a reuse's dead sandbox is (what is left of a
    dead member is quick to remove; a failed destroy waits for sweep.retry_cleanup, and
    the run goes on to the next member). True if this call let it go."""
    released = PoolStore(rt.store).release(
        member.lease_id, run_id, f"not resumable at its claim by run {run_id}: {why}",
        utcnow(), task_id)
    if released:
        destroy_lease(rt, member.lease_id, "pool member not resumable at claim", task_id)
    return released
