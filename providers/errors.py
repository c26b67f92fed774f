"""The one exception tree of leasekeeper, and which of its errors are worth a retry.

    LeasekeeperError
     ├── ConfigError                settings or provider registry are wrong; fix and restart
     ├── InvalidRequest             a payload or name is malformed; the caller must fix it
 │    └── ProviderMismatch      the sandbox key's live lease belongs to another provider
     ├── AcquireCancelled           the lease was ended (a destroy, a reclaim, a sweep) while
     │                              its acquire was making it: a race lost, not retried
     ├── NotFound                   a lease or run id the store does not know
     │    └── RunNotRecorded        a run's finish/detach before its acquire wrote it (transient)
     ├── StoreError
     │    ├── StoreUnavailable      the database went away or is locked (transient)
     │    │    └── StoreReadOnly    it answers but refuses writes: a replica (transient)
     │    └── StoreNotPermitted     the store's user lacks a right (terminal)
     ├── BrokerUnavailable          Redis (broker, results) is unreachable (transient)
     └── ProviderError              raised only at a provider boundary
          ├── TransientProviderError   429, 5xx, timeouts, dropped connections (retry)
          ├── TerminalProviderError    400/401/403/422, bad specs (fail now)
          │    └── ProviderConflict    a resource with our name exists and is not ours
          ├── DestroyIncomplete        some parts of a destroy failed; carries each failure
          ├── AcquireCleanupIncomplete acquire failed and so did the cleanup after it
          ├── CleanupAbandoned         the last allowed destroy failed; an operator decides
          └── SandboxReclaimFailedError reclaim's destroy failed (or the lease is abandoned)

Every message says what was wrong and what to do; none carries a secret value. Each class
is constructible from its message alone, so Celery's result backend can rebuild it.
Which errors a task retries is data: see ``TRANSIENT_ERRORS`` below, read by the retry
policy in tasks/base.py (``LeaseTask.retrying``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Self


class LeasekeeperError(Exception):
    """Root of every error leasekeeper raises on purpose."""

    def outside_a_task(self) -> str:
        """The message as a reader that runs no task says it (the CLI, the console, the
        exporter): without what a task would do about it."""
        return str(self)

    def with_retry_note(self, note: str) -> Self:
        """The same error with ``note`` in place of what its message promises a task does
        about it (a retry); itself when it promises nothing."""
        return self

    def given_up(self, retries: int) -> Self:
        """The error a task whose ``retries`` ran out raises: one whose message promises a
        retry says it gave up instead; any other, itself."""
        return self.with_retry_note(gave_up(retries))


class ConfigError(LeasekeeperError):
    """Settings or the provider registry are invalid."""


class InvalidRequest(LeasekeeperError):
    """A payload, id or name is malformed. Never retried."""


class ProviderMismatch(InvalidRequest):
    """The sandbox key's live lease belongs to another provider: refused, nothing touched."""

    @classmethod
    def of(cls, key: str, lease_id: str, lease_provider: str, asked: str) -> Self:
        return cls(
            f"provider-mismatch: sandbox key {key} is held by live lease {lease_id} of "
            f"provider {lease_provider}, not {asked}; nothing was touched. Ask for provider "
            f"{lease_provider} to reuse it, or use another sandbox_key"
        )


class AcquireCancelled(LeasekeeperError):
    """The lease was ended (a destroy, a run's finish and its reclaim, a sweep) while its
    acquire was provisioning or claiming it: the request was right, another one ended the
    lease first. Never retried; what the acquire made is destroyed, not left running."""

    @classmethod
    def of(cls, lease_id: str, state: str, doing: str) -> Self:
        return cls(
            f"acquire-cancelled: lease {lease_id} was ended ({state}) while it was being "
            f"{doing}; what it made is destroyed. If the run still needs a sandbox, start a "
            "new run"
        )


class NotFound(LeasekeeperError):
    """The store has no row for the id given."""


class RetryNoted(LeasekeeperError):
    """An error whose message ends with ``retry_note``: what the task that met it does
    about it. Readers that run no task leave the note out; a task whose retries ran out says
    it gave up instead."""

    def __init__(self, message: str, retry_note: str = "") -> None:
        super().__init__(message + retry_note)
        self.retry_note = retry_note

    def outside_a_task(self) -> str:
        return str(self).removesuffix(self.retry_note)

    def with_retry_note(self, note: str) -> Self:
        if not self.retry_note:
            return self
        return type(self)(self.outside_a_task(), note)


class RunNotRecorded(RetryNoted, NotFound):
    """A run's finish, detach or attach came before the acquire that records the run (a
    backend sends them right behind each other; the lanes may run them in either order).
    Transient: the retry lands once the acquire has written the run."""

    @classmethod
    def of(cls, run_id: str, call: str) -> Self:
        return cls(f"no run {run_id!r} yet; acquire a lease for it first",
                   f" (a {call} sent right behind its lease.acquire is retried until the run "
                   "is recorded)")


# How a transient provider error's message says what its task does about it. A task whose
# retries ran out says it gave up instead (``ProviderError.with_retry_note``); a destroy never
# retries a provider failure (sweep.retry_cleanup does), so its parts leave it out.
TASK_RETRIES = "; the task retries with backoff"


def gave_up(retries: int) -> str:
    """How a task's error ends once its retries ran out (StoreUnavailable's too)."""
    return f"; the task gave up after {retries} retries (LEASEKEEPER_TASK_MAX_RETRIES)"


class StoreError(LeasekeeperError):
    """The lease store failed."""


class StoreUnavailable(RetryNoted, StoreError):
    """The database is unreachable, restarting or locked; retrying later may succeed.
    ``retry_note`` ends the message: what the task that met it does about it."""


# Refused writes. Whether they are retried is decided here, by the class:
# - read-only (PostgreSQL 25006: a failover put us on a replica, or someone set
#   default_transaction_read_only; SQLite: a file or mount that became read-only) is
#   TRANSIENT: a failover ends, a primary comes back, and retrying with backoff is what
#   users expect. The store drops the connection that said it, so the retry connects anew
#   (a session keeps default_transaction_read_only as it was when it connected). If it
#   lasts longer than the retries, the task fails with the same message.
# - a missing right (PostgreSQL 42501 insufficient_privilege, e.g. REVOKE UPDATE ON
#   leases) is TERMINAL: it does not come back by itself, so the task fails at once
#   saying which user, which table and what to grant, rather than retrying for minutes.
class StoreReadOnly(StoreUnavailable):
    """The store answers but refuses writes (a replica, default_transaction_read_only, a
    read-only SQLite file); retried, as a failover ends."""


class StoreNotPermitted(StoreError):
    """The store's user lacks a right on a table; never retried: a grant, or running as
    the tables' owner, fixes it."""


# What a store that refuses means and how to fix it: one wording for a command or a
# worker's start (workers/preflight.py, which exits) and for a task (models/store.py).
READ_ONLY_STORE = ("this server or database is read-only (a replica, or "
                   "default_transaction_read_only=on); point LEASEKEEPER_STORE_URL at the "
                   "primary")
READ_ONLY_SQLITE = ("the SQLite file {path} is read-only (its or its folder's permissions, "
                    "a read-only mount, or mode=ro in the URL); make the file, its -wal and "
                    "-shm files and its folder writable by this user, or point "
                    "LEASEKEEPER_STORE_URL at a writable store")


def lacks_right(user: str, on: str | None = None) -> str:
    """Why a user may not do what was asked (``on``: "table leases", when known)."""
    where = f" on {on}" if on else ""
    return (f"the user {user} lacks a right this needs{where}; run it as the owner of the "
            "store's tables (the user that ran `leasekeeper db upgrade` first), or grant "
            f"{user} that right")


class BrokerUnavailable(LeasekeeperError):
    """The broker (Redis) cannot be reached; nothing was sent. Retrying later may succeed."""


class ProviderError(LeasekeeperError):
    """A provider could not do what was asked. ``status`` is the HTTP status of the API
    answer behind it, when there was one (set at the Kubernetes boundary); it is not in
    ``args``, so an error Celery rebuilds from the result backend has it as None."""

    status: int | None = None
    # The provider knows this call created nothing (its very first create was refused): an
    # acquire failing so has nothing to clean up. Like ``status``, not in ``args``.
    nothing_created: bool = False

    def with_status(self, status: int | None) -> Self:
        self.status = status
        return self

    def created_nothing(self) -> Self:
        self.nothing_created = True
        return self

    def without_retry_note(self) -> str:
        """The message without the promise that the task retries."""
        return str(self).replace(TASK_RETRIES, "")

    def with_retry_note(self, note: str) -> Self:
        """Its class and status kept (a copy)."""
        text = str(self)
        if TASK_RETRIES not in text:
            return self
        said = copy.copy(self)
        said.args = (text.replace(TASK_RETRIES, note), *self.args[1:])
        return said


class TransientProviderError(ProviderError):
    """The provider failed in a way that a later retry may fix."""


class TerminalProviderError(ProviderError):
    """The provider refused; retrying the same request will fail the same way."""


class ProviderConflict(TerminalProviderError):
    """A resource with this lease's name exists but belongs to someone else."""


@dataclass(frozen=True)
class PartFailure:
    """One part of a destroy (workload, pod, secret, process, workspace) that failed."""

    part: str
    error: ProviderError

    def describe(self) -> str:
        """What failed; a destroy never retries it itself (sweep.retry_cleanup does)."""
        return f"{self.part}: {self.error.without_retry_note()}"


class DestroyIncomplete(ProviderError):
    """Some parts of a destroy failed; every part was still attempted."""

    def __init__(self, message: str, *, failures: tuple[PartFailure, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures

    @classmethod
    def of(cls, name: str, failures: list[PartFailure]) -> DestroyIncomplete:
        detail = "; ".join(f.describe() for f in failures)
        return cls(
            f"destroy of {name} left {len(failures)} part(s) behind ({detail}); "
            "the lease stays pending_cleanup and sweep.retry_cleanup will try again",
            failures=tuple(failures),
        )

    @property
    def what_failed(self) -> str:
        """The failures alone, without the promise of a retry (none comes after the cap)."""
        return "; ".join(f.describe() for f in self.failures) or str(self)

    @property
    def transient(self) -> bool:
        return bool(self.failures) and all(is_transient(f.error) for f in self.failures)


class AcquireCleanupIncomplete(ProviderError):
    """Acquisition failed after something was created, and destroying it failed too."""

    @classmethod
    def of(cls, lease_id: str, cause: BaseException, cleanup: BaseException) -> Self:
        return cls(
            f"acquisition of lease {lease_id} failed and cleanup was incomplete: "
            f"acquire: {cause_of(cause)}; cleanup: {cause_of(cleanup)}. The lease is "
            "pending_cleanup and sweep.retry_cleanup will destroy what is left"
        )


def provider_bug(provider: str, call: str, name: str, exc: Exception
                 ) -> TerminalProviderError:
    """What a provider raised that is not a ProviderError (a bug, or a reply it could not
    read), as the terminal error the lifecycle records; ``exc`` is its cause. An
    InvalidRequest is the provider's own check of its input refusing it: no bug, and not
    called one."""
    why = ("" if isinstance(exc, InvalidRequest)
           else " (a provider bug, or a malformed reply)")
    wrapped = TerminalProviderError(
        f"provider {provider} {call} of {name} raised {type(exc).__name__}: "
        f"{str(exc)[:300]}{why}")
    wrapped.__cause__ = exc
    return wrapped


def unknown_backend(provider: str, backend: str, has: str) -> TerminalProviderError:
    """A spec's backend that a provider with one backend (``has``) does not have."""
    return TerminalProviderError(
        f"{provider}: unknown backend {backend[:40]!r}; the {provider} provider has one, "
        f"{has!r} (leave backend unset)")


# How a sweep's failed tick ends its error: a sweep is never retried, its next tick is.
NEXT_TICK = "; the sweep's next tick tries again"


def for_a_sweep(exc: BaseException) -> BaseException:
    """The error a sweep's tick raises for ``exc``: what a task would do about it (retry)
    is not what a sweep does. ``exc`` itself when it promises nothing."""
    return exc.with_retry_note(NEXT_TICK) if isinstance(exc, LeasekeeperError) else exc


def cause_of(exc: BaseException) -> str:
    """What went wrong, without what a retry would do about it (the caller says that)."""
    if isinstance(exc, DestroyIncomplete):
        return exc.what_failed
    return exc.without_retry_note() if isinstance(exc, ProviderError) else str(exc)


def abandoned_advice(lease_id: str) -> str:
    """What an operator does about an abandoned lease (README: Abandoned leases)."""
    return (f"The lease is abandoned: no sweep retries it and an operator must act. Fix the "
            f"cause, then run `leasekeeper leases retry {lease_id}`; if the sandbox was "
            f"removed by hand, `leasekeeper leases forget {lease_id}`")


class CleanupAbandoned(ProviderError):
    """The last allowed destroy of a lease failed: it is abandoned for an operator."""

    @classmethod
    def of(cls, lease_id: str, attempts: int, cause: str) -> Self:
        return cls(f"destroy of lease {lease_id} failed for the last allowed time (attempt "
                   f"{attempts}): {cause}. {abandoned_advice(lease_id)}")


class SandboxReclaimFailedError(ProviderError):
    """reclaim's destroy failed, or the run's lease is abandoned: the sandbox may still be
    running. Carries ``run_id``, ``sandbox_key`` and ``lease_id``; they travel in ``args``
    so the error Celery rebuilds from the result backend has them too."""

    def __init__(self, message: str, run_id: str | None = None,
                 sandbox_key: str | None = None, lease_id: str | None = None) -> None:
        super().__init__(message, run_id, sandbox_key, lease_id)
        self.run_id = run_id
        self.sandbox_key = sandbox_key
        self.lease_id = lease_id

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def of(cls, run_id: str, sandbox_key: str, lease_id: str, cause: str,
           abandoned: bool = False) -> Self:
        then = (abandoned_advice(lease_id) if abandoned else
                "The lease is pending_cleanup, no longer resumable, and sweep.retry_cleanup "
                "will retry it")
        return cls(
            f'reclaiming the sandbox for run "{run_id}" failed: the provider destroy of lease '
            f"{lease_id} (sandbox key {sandbox_key}) failed ({cause}); the sandbox may still "
            f"be running. {then}", run_id, sandbox_key, lease_id,
        )


# Read by the retry policy: these (and DestroyIncomplete whose parts are all transient)
# are retried with backoff; everything else fails at once with its reason.
TRANSIENT_ERRORS: frozenset[type[BaseException]] = frozenset(
    {TransientProviderError, StoreUnavailable, BrokerUnavailable, RunNotRecorded}
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, DestroyIncomplete):
        return exc.transient
    return any(isinstance(exc, kind) for kind in TRANSIENT_ERRORS)
