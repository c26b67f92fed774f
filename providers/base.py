"""The provider contract every adapter implements, and the values that cross it.

A provider creates what a lease needs under a name the store recorded first, reports
whether it can be resumed (expected states never raise), destroys it idempotently
(not-found is success, every part attempted, every failure reported), and lists what it
manages so orphan sweeps can find what the store lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from providers.spec import SandboxSpec

Meta = dict[str, Any]


class ResumeOutcome(StrEnum):
    RESUMABLE = "resumable"
    NOT_RESUMABLE = "not_resumable"


class DestroyOutcome(StrEnum):
    DESTROYED = "destroyed"
    ALREADY_GONE = "already_gone"


class AcquireOutcome(StrEnum):
    CREATED = "created"
    ADOPTED = "adopted"


class ClaimOutcome(StrEnum):
    CLAIMED = "claimed"  # resumable, and the run's data is in the sandbox's run directory
    NOT_RESUMABLE = "not_resumable"  # the member is no use (gone, exited): destroy it


@dataclass(frozen=True)
class AcquireRequest:
    lease_id: str
    name: str
    spec: SandboxSpec
    labels: dict[str, str]
    timeout_s: float
    # The warm pool this sandbox is created for (None: a run's own sandbox). A pool member
    # gets a run directory (RUN_DIR_ENV) that a later claim fills with its run's data.
    pool: str | None = None


# Every pool member's processes find their run's data in the directory this variable names
# (on Kubernetes a memory-backed emptyDir): ``run.json`` (run id, tenant, labels; no
# secrets), ``env`` (0600; ``KEY='value'`` lines, sh-quoted, env then secret_env), and
# ``claimed``, written last, once the others are complete (atomic renames).
RUN_DIR_ENV = "LEASEKEEPER_RUN_DIR"


@dataclass(frozen=True)
class ClaimRequest:
    """A run's data for the pool member it claimed. ``secret_env`` reaches that sandbox
    alone: never a log, an exception message, a manifest, provider meta or the store."""

    lease_id: str
    run_id: str
    tenant: str
    labels: dict[str, str]
    env: dict[str, str]
    secret_env: dict[str, str] = field(repr=False)
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Claimed:
    outcome: ClaimOutcome
    reason: str = ""  # why not resumable
    meta: Meta = field(default_factory=dict)  # merged into the lease's provider meta


@dataclass(frozen=True)
class Acquired:
    outcome: AcquireOutcome
    backend: str
    meta: Meta


@dataclass(frozen=True)
class LeaseHandle:
    """Everything a provider needs to find a lease's resources again."""

    name: str
    backend: str
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True)
class ResumeResult:
    outcome: ResumeOutcome
    reason: str = ""
    details: Meta = field(default_factory=dict)
    # Not resumable because the workload's command ended: as ManagedResource's fields (its
    # exit code; or, stopped before it exited, the reason), so the check records the runs
    # as sweep.finish_exited would. None when the provider cannot tell.
    exit_code: int | None = None
    exit_reason: str | None = None

    @classmethod
    def resumable(cls, **details: Any) -> ResumeResult:
        return cls(ResumeOutcome.RESUMABLE, "", details)

    @classmethod
    def not_resumable(cls, reason: str, exit_code: int | None = None,
                      exit_reason: str | None = None) -> ResumeResult:
        return cls(ResumeOutcome.NOT_RESUMABLE, reason, exit_code=exit_code,
                   exit_reason=exit_reason)

    @property
    def exited(self) -> bool:
        """The command is known to have ended (unknown is never taken for ended)."""
        return self.exit_code is not None or bool(self.exit_reason)


@dataclass(frozen=True)
class ManagedResource:
    """A resource carrying this installation's label, as the provider sees it."""

    name: str
    backend: str
    lease_id: str | None
    created_at: datetime | None
    meta: Meta = field(default_factory=dict)
    # The workload's command ended by itself with this code (a Job's container, a local
    # process's exit sentinel). None while it runs, or when the provider cannot tell:
    # unknown is never taken for finished.
    exit_code: int | None = None
    # It ended without an exit code of its own, stopped for this reason (a Job killed by
    # its active deadline: "DeadlineExceeded"). None unless the provider is sure of it.
    exit_reason: str | None = None


@runtime_checkable
class Provider(Protocol):
    name: str

    def lease_name(self, lease_id: str) -> str:
        """The deterministic, DNS-1123 safe name of the lease's main resource."""

    def check_spec(self, spec: SandboxSpec) -> None:
        """Raise TerminalProviderError if this provider can never run ``spec`` (checked
        before anything is recorded or created); cheap, no I/O beyond the local host."""

    def acquire(self, request: AcquireRequest) -> Acquired:
        """Create (or adopt, if ours) the lease's resources and wait until ready."""

    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        """Is the lease alive and usable? Raises only for unexpected provider errors."""

    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        """A warm pool member is taken by a run: check cheaply that it is resumable, then
        deliver the run's data into its run directory (RUN_DIR_ENV). Idempotent (a
        redelivered claim writes the same files again); expected states never raise
        (NOT_RESUMABLE); unexpected provider errors raise as usual."""

    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        """Delete every part; not-found is success; raises DestroyIncomplete on failures."""

    def list_managed(self) -> list[ManagedResource]:
        """Every resource labelled with this installation."""
