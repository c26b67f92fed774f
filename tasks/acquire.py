"""``lease.acquire``: give a run a sandbox, never losing track of what was created.

Order, each step one guarded transaction:
1. the run row (idempotent); a redelivered task continues with the lease the run has;
2. with ``reuse``, the thread's live lease is resume-checked and bound, or destroyed; one of
   another provider is refused (``provider-mismatch``) and left untouched;
2b. with ``pool``, a warm member of the pool is claimed (tasks/pool_claim.py): taken in one
   guarded statement, given the run's data, activated (``claimed``); a member that is not
   resumable is destroyed and the next one tried; an empty pool means a cold start below;
3. the lease *intent* (state provisioning, with the provider name it will use) is written
   before the provider creates anything, so a crash at any later point leaves a row;
4. the provider creates or adopts the resources and waits until ready; a cold start from a
   pool (empty, or no member resumable) is made as the pool makes its members (a run
   directory, no secret in what it creates) and given the run's data as a claim is, so the
   pool's template, which waits for its run's data, starts the same way;
5. provisioning → active. A failure after step 3 destroys what exists before the task
   gives up; if that destroy fails too, the lease is left pending_cleanup, never forgotten.
   The same acquire sent twice at once: both copies work on the one lease (the run's,
   with its deterministic sandbox name); the copy that finds it already active for its
   run answers ``already_acquired`` and leaves it alone, whether its own provider call
   succeeded or failed.
   A run's acquire repeated with another spec (a run id is an idempotency key) is
   refused with InvalidRequest naming the fields that differ, its lease and run left
   alone (tasks/same_spec.py: which fields count).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from celery.exceptions import Retry, SoftTimeLimitExceeded

from models.schema import AnyLease, LeaseState, RunStatus, utcnow
from models.store import LiveLeaseExists, NewLease, RunChange, RunRebound
from providers.base import (
    Acquired,
    AcquireOutcome,
    AcquireRequest,
    ClaimOutcome,
    LeaseHandle,
    Provider,
    ResumeOutcome,
    ResumeResult,
)
from providers.errors import (
    AcquireCancelled,
    AcquireCleanupIncomplete,
    InvalidRequest,
    LeasekeeperError,
    ProviderError,
    ProviderMismatch,
    TerminalProviderError,
    TransientProviderError,
    cause_of,
    is_transient,
    provider_bug,
)
from providers.spec import SandboxSpec, check_id, holds_secret, parse_spec
from tasks import pool_claim, secret_marks
from tasks.base import LeaseTask
from tasks.destroy import destroy_lease
from tasks.leases import EXPIRED, expired, handle, later, new_lease_id, sandbox_key
from tasks.redaction import is_secret_field, scrub_text
from tasks.resume import mark_not_resumable
from tasks.runs import clean_error
from tasks.same_spec import require_same_spec
from workers.app import app
from workers.pool_settings import resolve_spec
from workers.runtime import Runtime

log = logging.getLogger("leasekeeper.acquire")


class AcquireResult(StrEnum):
    ACQUIRED = "acquired"  # created fresh
    ADOPTED = "adopted"  # an earlier attempt had created it; taken over
    REUSED = "reused"  # the thread's live sandbox, resume-checked and bound
    ALREADY_ACQUIRED = "already_acquired"  # a redelivery, or a copy sent twice: the run has it
    CLAIMED = "claimed"  # a warm member of the spec's pool, given the run's data


@dataclass(frozen=True)
class Acquisition:
    result: AcquireResult
    run_id: str
    lease_id: str
    provider: str
    provider_lease_id: str
    backend: str | None
    sandbox_key: str

    def as_dict(self) -> dict[str, Any]:
        # plain strings (not the enums): the JSON is the same, and so is the text Celery
        # logs, by the cheap path (workers/result_repr.py)
        return {"result": self.result.value, "run_id": self.run_id, "lease_id": self.lease_id,
                "provider": self.provider, "provider_lease_id": self.provider_lease_id,
                "backend": self.backend, "sandbox_key": self.sandbox_key, "state": "active"}


def labels_for(rt: Runtime, lease_id: str, run_id: str, spec: SandboxSpec) -> dict[str, str]:
    return {**spec.labels, "leasekeeper.dev/installation": rt.settings.installation_id,
            "leasekeeper.dev/lease-id": lease_id, "leasekeeper.dev/tenant": spec.tenant,
            "leasekeeper.dev/run-id": run_id[:63],
            **({"leasekeeper.dev/pool": spec.pool} if spec.pool else {})}


def acquire_lease(
    rt: Runtime, run_id: str, spec: SandboxSpec, task_id: str | None, may_retry: bool
) -> Acquisition:
    store = rt.store
    spec = resolve_spec(rt.settings.pools, spec)  # a pool's template fills in the sandbox
    provider_name = spec.provider or rt.settings.provider
    provider = rt.provider(provider_name)
    key = sandbox_key(spec, provider_name, run_id)
    if not spec.reuse and spec.pool is None:
        # The common case, a new run's own sandbox: run row and intent in one transaction.
        # A run that exists already, or a key that is taken, takes the general path below.
        with contextlib.suppress(LiveLeaseExists):
            fresh = _new_lease(rt, provider, spec, key, run_id)
            if store.start_run_with_intent(run_id, fresh, task_id):
                return _provision(rt, provider, fresh, run_id, spec, task_id, may_retry)
    run = store.start_run(run_id, spec.thread_id, provider_name, key, bool(spec.secret_env))
    if run.status != RunStatus.RUNNING:
        raise InvalidRequest(f"run {run_id} is {run.status}; start a new run to get a sandbox")

    if run.lease_id is not None:  # redelivered, or retried after a transient failure
        lease = store.get_lease(run.lease_id)
        if lease.state in (LeaseState.ACTIVE, LeaseState.PROVISIONING):
            # the same run, another spec: refused, its sandbox left alone (same_spec.py)
            require_same_spec(run_id, lease, spec, key, provider_name)
        if lease.state == LeaseState.ACTIVE:
            return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, lease)
        if lease.state == LeaseState.PROVISIONING:
            # This attempt is alive: keep sweep.stuck_provisioning off the lease meanwhile.
            store.extend_acquire_deadline(run_id, later(rt.settings.acquire_timeout_s))
            if lease.claimed_at is None:
                return _provision(rt, provider, lease, run_id, spec, task_id, may_retry)
            resumed = _deliver_claim(rt, provider, lease, run_id, spec, task_id, may_retry)
            if resumed is not None:  # else: not resumable after all, and let go: go on
                return resumed
        elif lease.run_id == run_id:
            raise InvalidRequest(
                f"run {run_id}'s lease {lease.lease_id} already ended ({lease.state}: "
                f"{lease.last_error or lease.end_reason}); start a new run"
            )

    try:
        return _bind_new(rt, provider, provider_name, spec, key, run_id, run.lease_id,
                         task_id, may_retry)
    except RunRebound:
        # Another copy of this run's acquire, sent at once, bound the run to its sandbox
        # since the run was read (nothing of this copy's was written): the run's sandbox
        # is that one. Answer it, or wait for it with a retry; another spec is refused.
        return _twin_bound_first(rt, run_id, spec, key, provider_name)


def _bind_new(
    rt: Runtime, provider: Provider, provider_name: str, spec: SandboxSpec, key: str,
    run_id: str, bound_lease: str | None, task_id: str | None, may_retry: bool,
) -> Acquisition:
    """The run's sandbox when it has none (``bound_lease``: the ended lease it had when it
    was read, if any): the thread's live one (reuse), a pool's warm member, or a new one.
    Every bind is a compare-and-set on the run's lease: RunRebound if a twin bound it."""
    store = rt.store
    if spec.reuse:
        reused = _try_reuse(rt, provider, key, run_id, task_id, bound_lease)
        if reused is not None:
            return reused

    if spec.pool is not None:
        claimed = _claim(rt, provider, key, run_id, spec, task_id, may_retry, bound_lease)
        if claimed is not None:
            return claimed

    try:
        intent = store.create_intent(_new_lease(rt, provider, spec, key, run_id), task_id,
                                     bound_lease)
    except LiveLeaseExists:
        live = store.live_lease_for_key(key)
        if live is not None and live.run_id == run_id:
            # Another copy of this very acquire (sent twice at once) holds the key for the
            # run: its sandbox is the run's. Answer it, or wait for it with a retry; a
            # copy with another spec is refused.
            require_same_spec(run_id, live, spec, key, provider_name)
            if live.state == LeaseState.ACTIVE:
                return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, live)
            raise TransientProviderError(
                f"run {run_id}'s sandbox is being acquired by another copy of its "
                "lease.acquire; retrying") from None
        if spec.reuse:  # another run of the thread is acquiring it right now: retry, then reuse
            raise TransientProviderError(
                f"sandbox key {key} is being provisioned by another run; retrying"
            ) from None
        raise InvalidRequest(
            f"sandbox key {key} already has a live lease; pass reuse=true to share it, "
            "or another sandbox_key"
        ) from None
    return _provision(rt, provider, intent, run_id, spec, task_id, may_retry)


def _twin_bound_first(rt: Runtime, run_id: str, spec: SandboxSpec, key: str,
                      provider_name: str) -> Acquisition:
    run = rt.store.get_run(run_id)
    if run is None or run.lease_id is None:  # let go again since (a claim not resumable)
        raise TransientProviderError(f"run {run_id}'s sandbox changed while it was being "
                                     "acquired; retrying")
    lease = rt.store.get_lease(run.lease_id)
    require_same_spec(run_id, lease, spec, key, provider_name)
    if lease.state == LeaseState.ACTIVE:
        return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, lease)
    raise TransientProviderError(f"run {run_id}'s sandbox is being acquired by another copy "
                                 "of its lease.acquire; retrying")


def _new_lease(rt: Runtime, provider: Provider, spec: SandboxSpec, key: str,
               run_id: str) -> NewLease:
    lease_id, now = new_lease_id(), utcnow()
    return NewLease(
        lease_id=lease_id, sandbox_key=key, provider=provider.name,
        provider_lease_id=provider.lease_name(lease_id), reuse=spec.reuse,
        tenant=spec.tenant, thread_id=spec.thread_id, run_id=run_id, spec=spec.redacted(),
        acquire_deadline_at=now + timedelta(seconds=rt.settings.acquire_timeout_s),
        deadline_at=now + timedelta(seconds=spec.ttl_s or rt.settings.lease_ttl_s),
        idle_timeout_s=spec.idle_timeout_s or rt.settings.lease_idle_timeout_s,
        pool=spec.pool,
    )


def _try_reuse(
    rt: Runtime, provider: Provider, key: str, run_id: str, task_id: str | None,
    bound_lease: str | None,
) -> Acquisition | None:
    live = rt.store.live_lease_for_key(key)
    if live is None:
        return None
    if live.provider != provider.name:
        # The seed's provider gate, first: another provider's resume check or destroy of
        # this lease could only fail, or hit a stranger. Refuse; touch nothing of it.
        refused = ProviderMismatch.of(key, live.lease_id, live.provider, provider.name)
        rt.store.finish_run(run_id, RunStatus.FAILED, None, clean_error(str(refused)),
                            reclaim_due=False, claim_until=None)
        log.warning("acquire: run %s refused: %s", run_id, refused)
        raise refused
    if live.state == LeaseState.PROVISIONING:
        raise TransientProviderError(f"sandbox key {key} is still provisioning; retrying")
    ended = expired(live)  # past its ttl: never handed to a run (tasks/leases.py)
    check = (ResumeResult(ResumeOutcome.NOT_RESUMABLE, EXPIRED)
             if ended else provider.resume_check(handle(live), rt.settings.resume_timeout_s))
    if check.outcome == ResumeOutcome.RESUMABLE:
        rt.store.bind_run(run_id, live.lease_id, key, bound_lease)
        rt.store.touch(live.lease_id)
        return _acquisition(AcquireResult.REUSED, run_id, live)
    # Not resumable (pods cannot be restarted in place): clean it up, then acquire fresh.
    # The thread's earlier runs still on it get its command's exit, if the check found one.
    marked = mark_not_resumable(rt, live.lease_id, check, task_id,
                                "expired" if ended else "not_resumable", utcnow())
    if marked:
        destroy_lease(rt, live.lease_id, "not resumable at reuse", task_id)
    return None


def _claim(
    rt: Runtime, provider: Provider, key: str, run_id: str, spec: SandboxSpec,
    task_id: str | None, may_retry: bool, bound_lease: str | None,
) -> Acquisition | None:
    """Warm members of the spec's pool, oldest first, until one is resumable (at most
    pool_claim_attempts; each one that is not is destroyed); None: start cold."""
    for _ in range(rt.settings.pool_claim_attempts):
        try:
            member = pool_claim.take(rt, spec, key, run_id, task_id, bound_lease)
        except LiveLeaseExists:
            return None  # the cold path says what is wrong with the key
        if member is None:
            return None
        done = _deliver_claim(rt, provider, member, run_id, spec, task_id, may_retry)
        if done is not None:
            return done
    return None


def _deliver_claim(
    rt: Runtime, provider: Provider, member: AnyLease, run_id: str, spec: SandboxSpec,
    task_id: str | None, may_retry: bool,
) -> Acquisition | None:
    """The claimed member gets the run's data and becomes active; None if it was not
    resumable (it is let go and destroyed)."""
    labels = labels_for(rt, member.lease_id, run_id, spec)
    try:
        claimed = pool_claim.deliver(rt, provider, handle(member), member.lease_id, run_id,
                                     spec, labels)
    except ProviderError as exc:
        if is_transient(exc) and may_retry:
            raise  # the member stays the run's, provisioning: the retry delivers again
        if _cleanup_failed(rt, member.lease_id, exc, task_id) == Cleanup.TWIN_WON:
            return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id,
                                rt.store.get_lease(member.lease_id))
        raise
    match claimed.outcome:
        case ClaimOutcome.NOT_RESUMABLE:
            log.info("pool %s member %s not resumable for run %s: %s", member.pool,
                     member.lease_id, run_id, claimed.reason)
            pool_claim.discard(rt, member, run_id, claimed.reason, task_id)
            return None
        case ClaimOutcome.CLAIMED:
            if not pool_claim.activate(rt, member, claimed, run_id, task_id):
                current = rt.store.get_lease(member.lease_id)
                if _twin_won(current, run_id):  # the same acquire, delivered twice
                    return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, current)
                raise AcquireCancelled.of(member.lease_id, current.state, "claimed")
            log.info("lease %s claimed from pool %s for run %s", member.lease_id,
                     member.pool, run_id)
            return _acquisition(AcquireResult.CLAIMED, run_id, member)


def _provision(
    rt: Runtime, provider: Provider, lease: AnyLease | NewLease, run_id: str, spec: SandboxSpec,
    task_id: str | None, may_retry: bool,
) -> Acquisition:
    store = rt.store
    lease_id = lease.lease_id
    labels = labels_for(rt, lease_id, run_id, spec)
    # From a pool: created like a member (its secrets come with the delivery below).
    made = spec if spec.pool is None else spec.model_copy(update={"secret_env": {}})
    request = AcquireRequest(lease_id=lease_id, name=lease.provider_lease_id, spec=made,
                             labels=labels, timeout_s=rt.settings.acquire_timeout_s,
                             pool=spec.pool)
    try:
        acquired = provider.acquire(request)
        meta = acquired.meta
        if spec.pool is not None:
            meta = {**meta, **_deliver_cold(rt, provider, request, acquired, run_id, spec)}
    except ProviderError as exc:
        if is_transient(exc) and may_retry:
            raise  # the lease stays provisioning; the retry adopts what exists (and delivers)
        if _cleanup_failed(rt, lease_id, exc, task_id) == Cleanup.TWIN_WON:
            return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, store.get_lease(lease_id))
        raise
    except SoftTimeLimitExceeded:
        raise  # the lease stays provisioning: sweep.stuck_provisioning ends it
    except Exception as exc:  # a provider bug must still end in a recorded state
        log.exception("lease %s: provider %s acquire raised %s", lease_id, provider.name,
                      type(exc).__name__)
        wrapped = provider_bug(provider.name, "acquire", request.name, exc)
        if _cleanup_failed(rt, lease_id, wrapped, task_id) == Cleanup.TWIN_WON:
            return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, store.get_lease(lease_id))
        raise wrapped from exc
    now = utcnow()
    if not store.move(
        lease_id, {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
        f"ready ({acquired.outcome})", task_id, backend=acquired.backend,
        provider_meta=meta, ready_at=now,
        idle_deadline_at=now + timedelta(seconds=lease.idle_timeout_s),
    ):
        current = store.get_lease(lease_id)
        if _twin_won(current, run_id):
            # The same acquire, delivered twice at once: the other copy made (or adopted)
            # this very sandbox, by its deterministic name, and activated the lease first.
            # It is the run's sandbox: nothing here is ours alone to clean up.
            log.info("lease %s: another copy of run %s's acquire activated it first",
                     lease_id, run_id)
            return _acquisition(AcquireResult.ALREADY_ACQUIRED, run_id, current)
        # A sweep or destroy took the lease while we provisioned: do not leave what we made.
        _discard_made(rt, provider, lease_id, current.state, request.name, acquired, task_id)
        raise AcquireCancelled.of(lease_id, current.state, "provisioned")
    result = (AcquireResult.ADOPTED if acquired.outcome == AcquireOutcome.ADOPTED
              else AcquireResult.ACQUIRED)
    # DEBUG: Celery's own INFO line for the task's success carries the same result.
    log.debug("lease %s %s for run %s (%s %s)", lease_id, result, run_id, lease.provider,
              lease.provider_lease_id)
    # The activation changed none of what an acquisition names but the backend
    return Acquisition(result, run_id, lease_id, lease.provider, lease.provider_lease_id,
                       acquired.backend, lease.sandbox_key)


def _discard_made(rt: Runtime, provider: Provider, lease_id: str, state: str,
                  name: str, acquired: Acquired, task_id: str | None) -> None:
    """What this acquire made for a lease another task ended meanwhile is not left behind.

    A lease destroyed or abandoned already: back to pending_cleanup, and destroyed (a
    failure stays recorded there). A lease still ``destroying``: that destroy's provider
    call may have run before this sandbox existed (``already_gone``), so it is destroyed
    here too, by its name (a provider destroy is idempotent: whichever of the two calls
    comes last finds nothing). If that fails, the lease is taken to pending_cleanup (from
    destroying, or from destroyed if the other destroy ended first) with the error, so
    sweep.retry_cleanup retries it and no record says destroyed while the sandbox runs;
    the other destroy, its own final move refused, answers cleanup_pending
    (tasks/destroy.py). A lease pending_cleanup already is retried as it is."""
    store = rt.store
    if state != LeaseState.DESTROYING:
        store.transition(lease_id, {LeaseState.DESTROYED, LeaseState.ABANDONED},
                         LeaseState.PENDING_CLEANUP, "resources created after the lease "
                         "ended; destroying them", task_id, next_cleanup_at=utcnow(),
                         backend=acquired.backend, provider_meta=acquired.meta)
        destroy_lease(rt, lease_id, "created after the lease ended", task_id)
        return
    try:
        outcome = provider.destroy(LeaseHandle(name, acquired.backend, dict(acquired.meta)))
    except ProviderError as exc:
        error: ProviderError = exc
    except Exception as exc:  # a provider bug must still end in a recorded state
        log.exception("lease %s: provider %s destroy raised %s", lease_id, provider.name,
                      type(exc).__name__)
        error = provider_bug(provider.name, "destroy", name, exc)
    else:
        log.info("lease %s: destroyed (%s) what its acquire made while a destroy ran",
                 lease_id, outcome)
        return
    what = cause_of(error)
    moved = store.transition(
        lease_id, {LeaseState.DESTROYING, LeaseState.DESTROYED, LeaseState.ABANDONED},
        LeaseState.PENDING_CLEANUP, "resources created while the lease was being destroyed; "
        f"their destroy failed: {what}", task_id, last_error=what, next_cleanup_at=utcnow(),
        backend=acquired.backend, provider_meta=acquired.meta)
    log.warning("lease %s: the destroy of what its acquire made while a destroy ran failed "
                "(%s); %s", lease_id, what, "left pending_cleanup for sweep.retry_cleanup"
                if moved is not None else "the lease was already ended another way")


def _deliver_cold(rt: Runtime, provider: Provider, request: AcquireRequest, acquired: Acquired,
                  run_id: str, spec: SandboxSpec) -> dict[str, Any]:
    """The run's data into the run directory of the sandbox just created for it from its
    pool's template, as a claim delivers it (idempotent: a retry delivers again); the
    claim's meta. A sandbox that cannot take it right after its creation is an acquire
    failure (terminal: the lease is cleaned up and the run failed with the reason)."""
    claimed = pool_claim.deliver(
        rt, provider, LeaseHandle(request.name, acquired.backend, dict(acquired.meta)),
        request.lease_id, run_id, spec, request.labels)
    match claimed.outcome:
        case ClaimOutcome.CLAIMED:
            return dict(claimed.meta)
        case ClaimOutcome.NOT_RESUMABLE:
            raise TerminalProviderError(
                f"{provider.name}: sandbox {request.name}, started cold from pool "
                f"{spec.pool}'s template for run {run_id}, could not take the run's data "
                f"right after its creation ({claimed.reason}); check that the template's "
                "command keeps running until its run's data arrives, then retry the run")


class Cleanup(StrEnum):
    """What a failed acquire's cleanup did."""

    CLEANED = "cleaned"  # the lease is ended and its sandbox destroyed (or left pending)
    TWIN_WON = "twin_won"  # another copy of the run's acquire activated it: left alone


def _twin_won(lease: AnyLease, run_id: str) -> bool:
    """The lease is active for this very run: another copy of its acquire won."""
    return lease.state == LeaseState.ACTIVE and lease.run_id == run_id


def _cleanup_failed(rt: Runtime, lease_id: str, cause: ProviderError,
                    task_id: str | None) -> Cleanup:
    """Destroy whatever a failed acquire left; record pending_cleanup if that fails too.
    A lease another copy of the same acquire activated meanwhile is the run's sandbox,
    not this attempt's leftovers: it is left alone (TWIN_WON)."""
    what = cause_of(cause)  # recorded: no promise of a retry, the acquire has stopped
    marked = rt.store.transition(
        lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP,
        f"acquire failed: {what}", task_id, end_reason="acquire_failed",
        last_error=what, next_cleanup_at=utcnow())
    lease = rt.store.get_lease(lease_id)
    if marked is None and lease.run_id is not None and _twin_won(lease, lease.run_id):
        log.info("lease %s: this acquire copy failed (%s), another one activated it",
                 lease_id, type(cause).__name__)
        return Cleanup.TWIN_WON
    if lease.run_id:
        rt.store.finish_run(lease.run_id, RunStatus.FAILED, None,
                            clean_error(f"acquire failed: {what}"),
                            reclaim_due=False, claim_until=None)
    if cause.nothing_created and marked is not None:
        # The provider knows this acquire made nothing (its first create was refused): no
        # destroy, which would fail the same way (no rights there, no namespace) and leave
        # the lease pending_cleanup for a person over nothing. What an earlier attempt of
        # the lease may have left carries its labels: sweep.orphans finds it.
        rt.store.move(lease_id, {LeaseState.PENDING_CLEANUP}, LeaseState.DESTROYED,
                      "destroyed (nothing was created): acquire failed", task_id,
                      next_cleanup_at=None)
        return Cleanup.CLEANED
    done = destroy_lease(rt, lease_id, "acquire failed", task_id)
    if done.error is not None:
        # A provider that cleans up after itself (kubernetes) already raised this error
        # type: report its acquire error once, not nested inside a second report.
        first = cause.__cause__ if isinstance(cause, AcquireCleanupIncomplete) else None
        raise AcquireCleanupIncomplete.of(lease_id, first or cause, done.error) from None
    return Cleanup.CLEANED


def _acquisition(result: AcquireResult, run_id: str, lease: Any) -> Acquisition:
    return Acquisition(result, run_id, lease.lease_id, lease.provider, lease.provider_lease_id,
                       lease.backend, lease.sandbox_key)


def parse_acquire(run_id: object, spec: object) -> tuple[str, SandboxSpec]:
    """Validate an acquire payload; InvalidRequest names every problem."""
    try:
        check_id("run_id", run_id)
        parsed = parse_spec(spec)
    except ValueError as exc:
        raise InvalidRequest(f"invalid lease.acquire payload: {_safe(exc)}") from None
    assert isinstance(run_id, str)
    if parsed.secret_env and holds_secret(run_id, parsed.secret_values().values()):
        raise InvalidRequest("invalid lease.acquire payload: run_id holds a secret_env value; "
                             "a run id is stored, logged and shown in clear: use another")
    return run_id, parsed


def _safe(exc: ValueError) -> str:
    """A validation message without input values (they may be secrets)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(_problem(".".join(map(str, e["loc"])) or "spec",
                                  e["msg"].removeprefix("Value error, "))
                         for e in errors(include_input=False))
    return str(exc)


def _problem(where: str, what: str) -> str:
    # Not "secret_env: ..." (or "secretEnv: ..."): the worker's scrubber takes that for a
    # dumped mapping and withholds the rest of the line (tasks/redaction.py), which would
    # hide the reason.
    if is_secret_field(where.rpartition(".")[2]):
        return f"{where} is invalid: {what}"
    return f"{where}: {what}"


@app.task(bind=True, base=LeaseTask, name="lease.acquire")
def acquire(self: LeaseTask, run_id: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    run_id, parsed = parse_acquire(run_id, spec)
    rt = self.runtime
    parsed = resolve_spec(rt.settings.pools, parsed)  # an unknown pool is refused here
    # A spec the provider can never run (a local command that does not exist) is refused
    # here, before a run or lease row exists or anything is created.
    rt.provider(parsed.provider or rt.settings.provider).check_spec(parsed)

    def keep_provisioning(countdown_s: float) -> None:
        # The retry will pick the lease up again: its deadline covers the wait and the try.
        rt.store.extend_acquire_deadline(run_id, later(countdown_s + rt.settings.acquire_timeout_s))

    try:
        with self.retrying(before_retry=keep_provisioning):
            if parsed.secret_env:  # before the sandbox has them: any finish can scrub them
                secret_marks.leave(rt, run_id, parsed.thread_id, parsed.secret_values())
            done = acquire_lease(rt, run_id, parsed, self.request.id, self.may_retry)
    except Retry:
        raise
    except Exception as exc:
        _give_up(rt, run_id, exc)
        raise
    return done.as_dict()


def _give_up(rt: Runtime, run_id: str, exc: Exception) -> None:
    """The acquire failed for good: a run it left running with no lease (refused after
    its row was written: a key with a live lease, a resume check's 403...) fails with the
    reason, so its record tells the truth at once. Best effort: with the store down,
    sweep.reap_runs fails it later."""
    with contextlib.suppress(LeasekeeperError):
        if rt.store.fail_leaseless_run(
                run_id, scrub_text(f"acquire failed: {type(exc).__name__}: {exc}")
        ) == RunChange.CHANGED:
            log.info("acquire for run %s gave up before a lease was recorded: %s", run_id,
                     type(exc).__name__)
