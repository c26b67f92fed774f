"""``lease.destroy``: the forced cleanup path, idempotent, never forgetting a failure.

The lease is claimed (live or pending_cleanup → destroying) in one guarded transaction,
then the provider destroys every part. Success → destroyed. Failure → pending_cleanup with
the attempt counted and the next attempt scheduled (backoff), or abandoned once the
attempt cap is reached; either way the lease stays in the store, reachable, and the task
fails loudly so Flower shows it. Any exception the provider raises ends that way, not only
a ProviderError: a ValueError from a malformed reply is recorded as a failed attempt too,
never left ``destroying``. The first claim records the reason as the lease's
``end_reason`` (unless it has one), so a later retry keeps the original reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from models.schema import FINAL_STATES, LIVE_STATES, LeaseState
from providers.errors import (
    CleanupAbandoned,
    DestroyIncomplete,
    InvalidRequest,
    ProviderError,
    TerminalProviderError,
    abandoned_advice,
    cause_of,
    is_transient,
    provider_bug,
)
from providers.spec import MIN_SUBSTRING_SECRET_CHARS
from tasks import secret_marks
from tasks.base import LeaseTask
from tasks.leases import handle, later
from tasks.operator import operators_own
from tasks.sent_cut import cut_note, received
from workers.app import app
from workers.runtime import Runtime
from workers.settings import CLEANUP_BACKOFF_MAX_S

log = logging.getLogger("leasekeeper.destroy")
DESTROYABLE = LIVE_STATES | {LeaseState.PENDING_CLEANUP}
DEFAULT_REASON = "requested"
REASON_MAX_CHARS = 200  # what a destroy's event keeps of its reason
END_REASON_MAX_CHARS = 64  # what the lease's end_reason (and its runs' error) keeps


def checked_reason(reason: object) -> str:
    """A destroy payload's reason: a string, or null (JSON's "none given": the default)."""
    if reason is None:
        return DEFAULT_REASON
    if not isinstance(reason, str):
        raise InvalidRequest("invalid lease.destroy payload: reason must be a string or "
                             f"null; got {type(reason).__name__}")
    return reason


def clean_reason(reason: str, marks: secret_marks.Marks | None = None) -> str:
    """A destroy reason as the store keeps it: trimmed, scrubbed as a run's error is
    (tasks/sent_cut.py ``received``: with ``marks``, of the lease's run's and thread's
    secrets too, before any cut), what no store holds replaced (tasks/text.py), at most
    REASON_MAX_CHARS; blank: "requested". A reason its sender cut to fit the message ends
    in the whole length, as a run's error does (``... [N characters; the rest cut]``).
    Cleaning a clean reason changes nothing."""
    got = received(reason.strip(), marks, REASON_MAX_CHARS)
    kept = got.text.rstrip()
    if got.sender_cut:
        note = cut_note(got.total_chars)
        kept = kept[:REASON_MAX_CHARS - len(note)].rstrip() + note
    return kept[:REASON_MAX_CHARS].rstrip() or DEFAULT_REASON


class DestroyResult(StrEnum):
    DESTROYED = "destroyed"
    ALREADY_ENDED = "already_ended"  # destroyed or abandoned before this call
    IN_PROGRESS = "in_progress"  # another worker holds the destroy claim
    CLEANUP_PENDING = "cleanup_pending"  # failed; sweep.retry_cleanup will try again
    ABANDONED = "abandoned"  # failed for the last allowed time
    REBOUND = "rebound"  # bound to another run meanwhile (a reuse): left alone


@dataclass(frozen=True)
class Destroyed:
    lease_id: str
    result: DestroyResult
    state: str
    error: ProviderError | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "result": self.result.value,
                "state": str(self.state)}  # plain strings: see Acquisition.as_dict


def cleanup_delay_s(rt: Runtime, attempts: int) -> float:
    """Backoff before cleanup attempt ``attempts + 1``: doubling, capped at an hour."""
    return float(min(rt.settings.cleanup_backoff_s * 2 ** max(attempts - 1, 0),
                     CLEANUP_BACKOFF_MAX_S))


def destroy_lease(rt: Runtime, lease_id: str, reason: str, task_id: str | None,
                  bound_to: str | None = None) -> Destroyed:
    """Destroy the lease's sandbox; with ``bound_to``, only while the lease is bound to
    that run (a reclaim: a run of the thread that reused the sandbox meanwhile keeps it)."""
    store = rt.store
    reason = clean_reason(reason)
    claimed = store.claim_to_destroy(lease_id, DESTROYABLE, f"destroy: {reason}", task_id,
                                     first_end_reason=reason[:END_REASON_MAX_CHARS],
                                     bound_to=bound_to)
    if claimed is None:
        current = store.get_lease(lease_id)
        if current.state in FINAL_STATES:
            return Destroyed(lease_id, DestroyResult.ALREADY_ENDED, current.state)
        if bound_to is not None and current.run_id != bound_to:
            return Destroyed(lease_id, DestroyResult.REBOUND, current.state)
        return Destroyed(lease_id, DestroyResult.IN_PROGRESS, current.state)
    try:
        outcome = rt.provider(claimed.provider).destroy(handle(claimed))
    except ProviderError as exc:
        return _record_failure(rt, claimed.lease_id, claimed.cleanup_attempts + 1, exc, task_id)
    except Exception as exc:  # a provider bug must still end in a recorded state
        log.exception("lease %s: provider %s destroy raised %s", lease_id, claimed.provider,
                      type(exc).__name__)
        wrapped = provider_bug(claimed.provider, "destroy", claimed.provider_lease_id, exc)
        return _record_failure(rt, claimed.lease_id, claimed.cleanup_attempts + 1, wrapped,
                               task_id)
    end_reason = claimed.end_reason or reason
    if store.move(lease_id, {LeaseState.DESTROYING}, LeaseState.DESTROYED,
                  f"destroyed ({outcome}): {reason}", task_id,
                  end_reason=end_reason[:END_REASON_MAX_CHARS],
                  next_cleanup_at=None):
        return Destroyed(lease_id, DestroyResult.DESTROYED, LeaseState.DESTROYED)
    return _overtaken(rt, lease_id)


def _overtaken(rt: Runtime, lease_id: str) -> Destroyed:
    """The lease left ``destroying`` under this destroy: an acquire that was provisioning
    it made its sandbox after this destroy's provider call, could not destroy it either,
    and took the lease to pending_cleanup (tasks/acquire.py ``_discard_made``). Not a
    success: the sandbox may still be running until sweep.retry_cleanup destroys it."""
    current = rt.store.get_lease(lease_id)
    if current.state == LeaseState.DESTROYED:
        return Destroyed(lease_id, DestroyResult.DESTROYED, current.state)
    error = TerminalProviderError(
        f"lease {lease_id}: a sandbox its acquire made while this destroy ran could not be "
        f"destroyed ({current.last_error or 'no error recorded'}); the lease is "
        f"{current.state} and sweep.retry_cleanup will retry it")
    if current.state == LeaseState.ABANDONED:
        return Destroyed(lease_id, DestroyResult.ABANDONED, current.state,
                         CleanupAbandoned.of(lease_id, current.cleanup_attempts,
                                             current.last_error or "unknown"))
    return Destroyed(lease_id, DestroyResult.CLEANUP_PENDING, current.state, error)


def _record_failure(
    rt: Runtime, lease_id: str, attempts: int, exc: ProviderError, task_id: str | None
) -> Destroyed:
    cap = rt.settings.cleanup_max_attempts
    if attempts >= cap:
        cause = cause_of(exc)
        rt.store.transition(
            lease_id, {LeaseState.DESTROYING}, LeaseState.ABANDONED,
            f"destroy failed {attempts} times (cap {cap}); left for an operator: {cause}",
            task_id, cleanup_attempts=attempts, last_error=cause, next_cleanup_at=None,
        )
        log.error("lease %s abandoned after %d failed destroys (%s). %s", lease_id, attempts,
                  cause, abandoned_advice(lease_id))
        return Destroyed(lease_id, DestroyResult.ABANDONED, LeaseState.ABANDONED,
                         CleanupAbandoned.of(lease_id, attempts, cause))
    delay_s = 0.0 if is_transient(exc) and attempts == 1 else cleanup_delay_s(rt, attempts)
    # The sweep retries a destroy, not the task: a provider's "the task retries" is cut.
    what = str(exc) if isinstance(exc, DestroyIncomplete) else cause_of(exc)
    rt.store.transition(
        lease_id, {LeaseState.DESTROYING}, LeaseState.PENDING_CLEANUP,
        f"destroy attempt {attempts} failed, next in {delay_s:.0f}s: {what}", task_id,
        cleanup_attempts=attempts, last_error=what, next_cleanup_at=later(delay_s),
    )
    log.warning("lease %s destroy attempt %d failed: %s", lease_id, attempts, exc)
    return Destroyed(lease_id, DestroyResult.CLEANUP_PENDING, LeaseState.PENDING_CLEANUP, exc)


def without_marked_secrets(rt: Runtime, lease_id: str, reason: str) -> str:
    """A caller's reason cleaned (:func:`clean_reason`) with the secrets of the lease's
    run and thread scrubbed, whichever process saw them (tasks/secret_marks.py), as
    run.finish's error is: the reason is stored and shown (events, the lease's end, its
    runs' error), and so is a forget's (`leasekeeper leases forget --reason`). The
    default reason, an operator's own (tasks/operator.operators_own) or
    one too short to hold a secret costs no read of the marks; BrokerUnavailable
    (retried) when the marks cannot be read, so a reason is never stored unsearched."""
    if (reason == DEFAULT_REASON or len(reason) < MIN_SUBSTRING_SECRET_CHARS
            or operators_own(reason)):
        return reason  # destroy_lease cleans it (clean_reason), as every reason
    lease = rt.store.get_lease(lease_id)
    if lease.run_id is None and lease.thread_id is None:
        return reason  # a pool member no run has had: no secret given to it
    marks = secret_marks.load(rt, lease.run_id or "", lease.thread_id)
    if secret_marks.lost(rt, marks, lease.spec, lease.run_id, lease_id):
        return "withheld: its run's secret marks are lost"  # fits END_REASON_MAX_CHARS
    return clean_reason(reason, marks)


@app.task(bind=True, base=LeaseTask, name="lease.destroy")
def destroy(self: LeaseTask, lease_id: str,
            reason: str | None = DEFAULT_REASON) -> dict[str, Any]:
    reason = checked_reason(reason)
    with self.retrying():
        reason = without_marked_secrets(self.runtime, lease_id, reason)
        done = destroy_lease(self.runtime, lease_id, reason, self.request.id)
    if done.error is not None:
        raise done.error  # loud in Flower; the lease itself waits for sweep.retry_cleanup
    return done.as_dict()
