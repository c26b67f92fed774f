"""Tables of the lease store: leases, runs and the append-only lease event log.

Times are naive UTC. A lease's ``state`` only moves through guarded transitions in
store.py; ``live_key`` is the sandbox key while the lease is live (provisioning, warm or
active) and NULL otherwise, so a plain unique index keeps live leases unique per key on
SQLite and PostgreSQL alike.

Warm pools (workers/pool_settings.py, models/pool_store.py): a pool *member* is a lease
with ``pool`` set, created by ``sweep.fill_pools`` with no run (``run_id`` NULL), that
waits ``warm`` until a run claims it (``claimed_at`` set, bound to the run) or it is
drained. A lease a run asked a pool for but got cold (the pool was empty) has ``pool``
set too, and ``claimed_at`` NULL. The ``pools`` table holds each pool's circuit breaker
and is the row fillers lock while they count members, so ``max_size`` always holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class LeaseState(StrEnum):
    PROVISIONING = "provisioning"  # intent recorded, provider create may be under way
    WARM = "warm"  # a ready pool member no run has claimed yet
    ACTIVE = "active"  # ready and resumable
    DESTROYING = "destroying"  # a worker claimed the destroy
    PENDING_CLEANUP = "pending_cleanup"  # must be destroyed (again); not resumable
    DESTROYED = "destroyed"  # final: every part is gone
    ABANDONED = "abandoned"  # final: cleanup gave up after the cap; an operator decides


LIVE_STATES = frozenset({LeaseState.PROVISIONING, LeaseState.WARM, LeaseState.ACTIVE})
FINAL_STATES = frozenset({LeaseState.DESTROYED, LeaseState.ABANDONED})
_S = LeaseState
# Every (from, to) move the lifecycle makes (None: the lease's first event), for the
# exporter's transitions counter to start each at 0. The diagram in README's "What it
# does", and the moves it leaves out: an acquire's claim failing or being cancelled, an
# orphan recorded (None -> pending_cleanup), resources created after the lease ended
# (destroyed/abandoned -> pending_cleanup), an operator's retry or forget of an abandoned
# lease, a failed acquire whose provider holds nothing (pending_cleanup -> destroyed).
LEASE_TRANSITIONS: tuple[tuple[LeaseState | None, LeaseState], ...] = (
    (None, _S.PROVISIONING), (None, _S.PENDING_CLEANUP),
    (_S.PROVISIONING, _S.ACTIVE), (_S.PROVISIONING, _S.WARM),
    (_S.PROVISIONING, _S.PENDING_CLEANUP), (_S.PROVISIONING, _S.DESTROYING),
    (_S.PROVISIONING, _S.ABANDONED),
    (_S.WARM, _S.PROVISIONING), (_S.WARM, _S.PENDING_CLEANUP), (_S.WARM, _S.DESTROYING),
    (_S.ACTIVE, _S.PENDING_CLEANUP), (_S.ACTIVE, _S.DESTROYING),
    (_S.PENDING_CLEANUP, _S.DESTROYING), (_S.PENDING_CLEANUP, _S.DESTROYED),
    (_S.DESTROYING, _S.DESTROYED), (_S.DESTROYING, _S.PENDING_CLEANUP),
    (_S.DESTROYING, _S.ABANDONED),
    (_S.ABANDONED, _S.PENDING_CLEANUP), (_S.ABANDONED, _S.DESTROYED),
    (_S.DESTROYED, _S.PENDING_CLEANUP),
)


class RunStatus(StrEnum):
    RUNNING = "running"
    INTERRUPTED = "interrupted"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


TERMINAL_RUN_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED})


class ReclaimOutcome(StrEnum):
    DESTROYED = "destroyed"
    DESTROY_FAILED = "destroy-failed"
    NO_SANDBOX_KEY = "no-sandbox-key"
    NOT_FOUND = "not-found"
    PROVIDER_MISMATCH = "provider-mismatch"


UNRECLAIMED = "reclaim_due IS TRUE AND reclaim_outcome IS NULL"
LEASELESS = "status = 'running' AND lease_id IS NULL"
# Runs not finished (running, interrupted): models/store.py UNFINISHED_RUN_STATUSES
UNFINISHED = "status IN ('running', 'interrupted')"


def where(predicate: str) -> dict[str, Any]:
    """A partial index's predicate, on PostgreSQL and SQLite alike."""
    return {"postgresql_where": text(predicate), "sqlite_where": text(predicate)}


def in_state(state: str) -> dict[str, Any]:
    return where(f"state = '{LeaseState(state)}'")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime()}  # noqa: RUF012


class Lease(Base):
    __tablename__ = "leases"

    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # not indexed: no query looks a lease up by it but through live_key (0012_perf12)
    sandbox_key: Mapped[str] = mapped_column(String(128))
    live_key: Mapped[str | None] = mapped_column(String(128))  # unique: uq_leases_live_key
    provider: Mapped[str] = mapped_column(String(64))
    provider_lease_id: Mapped[str] = mapped_column(String(253), index=True)
    backend: Mapped[str | None] = mapped_column(String(64))
    provider_meta: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(32))
    reuse: Mapped[bool] = mapped_column(default=False)
    tenant: Mapped[str] = mapped_column(String(64))
    thread_id: Mapped[str | None] = mapped_column(String(128))
    run_id: Mapped[str | None] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)  # redacted: no secret values
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    ready_at: Mapped[datetime | None]
    acquire_deadline_at: Mapped[datetime]
    deadline_at: Mapped[datetime]
    idle_timeout_s: Mapped[int]
    idle_deadline_at: Mapped[datetime | None]
    cleanup_attempts: Mapped[int] = mapped_column(default=0)
    next_cleanup_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(String(64))
    last_error: Mapped[str | None] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer, default=1)
    # The warm pool it is a member of, or that its run asked for (see the module's doc).
    pool: Mapped[str | None] = mapped_column(String(63))
    claimed_at: Mapped[datetime | None]  # when a run claimed it from its pool
    # The state its last change left: a state change sets it from the row it replaces, in
    # the same UPDATE, so the change's event names the state really left without a locked
    # read first (models/rawsql.py).
    prev_state: Mapped[str | None] = mapped_column(String(32))

    # Listings (newest first by id: ids begin with their creation time; optionally by
    # state or tenant) and each sweep's read are index range scans in the order they read,
    # whatever the history's size (bench/sweeps.py). The partial indexes hold only the few
    # rows in their state, so they cost writes only there. Every index is written by every
    # state change (the state is in most of them): none is here that no query needs.
    __table_args__ = (
        Index("ix_leases_active_deadline", "deadline_at", **in_state("active")),
        Index("ix_leases_active_idle_deadline", "idle_deadline_at", **in_state("active")),
        Index("ix_leases_provisioning_deadline", "acquire_deadline_at", "lease_id",
              **in_state("provisioning")),
        Index("ix_leases_destroying_updated", "updated_at", **in_state("destroying")),
        Index("ix_leases_pending_cleanup_created", "created_at", "lease_id",
              **in_state("pending_cleanup")),
        # The filtered keyset pages of `leases list` and the console (models/reports.py)
        # by its (state, lease_id) prefix, and the metrics' counts by state x provider x
        # tenant, which it covers: one index led by the state, since every state change
        # moves an entry in each (migration 0011_perf12).
        Index("ix_leases_state_lease_id_provider_tenant", "state", "lease_id", "provider",
              "tenant"),
        Index("ix_leases_tenant_lease_id", "tenant", "lease_id"),
        # Warm pools: a claim takes the oldest warm member of its pool; fillers count a
        # pool's unclaimed members by state (models/pool_store.py).
        Index("ix_leases_warm_pool_created", "pool", "created_at", "lease_id",
              **in_state("warm")),
        Index("ix_leases_pool_members", "pool", "state",
              **where("pool IS NOT NULL AND run_id IS NULL")),
        # Live leases are unique per sandbox key; the rest (most of the history) have no
        # key and no entry (migration 0010_perf12).
        Index("uq_leases_live_key", "live_key", unique=True, **where("live_key IS NOT NULL")),
    )


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A leases row as the store's plain-SQL path reads it (models/rawsql.py): detached,
    for reading; the fields are Lease's columns, in the table's order."""

    lease_id: str
    sandbox_key: str
    live_key: str | None
    provider: str
    provider_lease_id: str
    backend: str | None
    provider_meta: dict[str, Any]
    state: str
    reuse: bool
    tenant: str
    thread_id: str | None
    run_id: str | None
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    ready_at: datetime | None
    acquire_deadline_at: datetime
    deadline_at: datetime
    idle_timeout_s: int
    idle_deadline_at: datetime | None
    cleanup_attempts: int
    next_cleanup_at: datetime | None
    end_reason: str | None
    last_error: str | None
    version: int
    pool: str | None
    claimed_at: datetime | None
    prev_state: str | None


# A lease as read by either path: the ORM's row, or the plain-SQL path's record.
AnyLease = Lease | LeaseRecord


@dataclass(frozen=True, slots=True)
class ClaimedLease:
    """What a destroy reads of the lease it has just claimed (``Store.claim_to_destroy``):
    the lease's provider and handle, its attempts so far, the state it left and its end
    reason. Only these columns come back from the claim (a whole row, converted, cost
    more than the rest of the claim's Python)."""

    prev_state: str | None
    end_reason: str | None
    lease_id: str
    provider: str
    provider_lease_id: str
    backend: str | None
    provider_meta: dict[str, Any]
    spec: dict[str, Any]
    cleanup_attempts: int


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    thread_id: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    exit_code: Mapped[int | None]
    provider: Mapped[str] = mapped_column(String(64))
    sandbox_key: Mapped[str | None] = mapped_column(String(128))
    lease_id: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    detached_since: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    # The run's acquire carried secret_env (migration 0013_marks14): its text is withheld
    # once its secret marks are lost (tasks/secret_marks.py), whatever its lease's spec says.
    secret_env_given: Mapped[bool] = mapped_column(default=False, server_default=false())
    error: Mapped[str | None] = mapped_column(Text)
    reclaim_due: Mapped[bool] = mapped_column(default=False)
    reclaim_claimed_until: Mapped[datetime | None]
    reclaim_outcome: Mapped[str | None] = mapped_column(String(32))
    reclaimed_at: Mapped[datetime | None]

    __table_args__ = (
        Index("ix_runs_status_detached", "status", "detached_since"),
        # every lease end settles the runs on its lease (models/rawsql.py)
        Index("ix_runs_lease_id", "lease_id"),
        # sweep.reap_runs' lost reclaims: only the runs whose reclaim has no outcome yet.
        Index("ix_runs_reclaim_pending", "finished_at", **where(UNRECLAIMED)),
        # Only the rows with a value (queries ask for one): a run's thread and its reclaim
        # time are NULL for most of the history (migration 0010_perf12).
        Index("ix_runs_thread_id", "thread_id", **where("thread_id IS NOT NULL")),
        Index("ix_runs_reclaimed_at", "reclaimed_at", **where("reclaimed_at IS NOT NULL")),
        # `runs list`: newest first, keyset pages (models/reports.py)
        Index("ix_runs_started", "started_at", "run_id"),
        # sweep.reap_runs' runs whose acquire never recorded a lease (almost always empty)
        Index("ix_runs_leaseless", "started_at", **where(LEASELESS)),
        # sweep.reap_runs' runs not finished on an ended lease: it reads the runs not
        # finished, oldest first, and only those (migration 0014_perf12)
        Index("ix_runs_unfinished_started", "started_at", **where(UNFINISHED)),
    )


class LeaseEvent(Base):
    """One state change of a lease: written by the statement (PostgreSQL) or transaction
    (SQLite) that makes the change, from the row it changed, so it always names a lease
    that exists. No foreign key: its check was a lookup of the lease (and, on PostgreSQL,
    a trigger and a row lock) on every event of every change, to prove what the writing
    statement already guarantees; nothing deletes leases but an operator by hand."""

    __tablename__ = "lease_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(String(64), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    task_id: Mapped[str | None] = mapped_column(String(64))


class Pool(Base):
    """One row per warm pool ever filled: its circuit breaker, and the row fillers lock
    (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serialises
    writers anyway) while they count its members and insert new ones, so two fillers can
    never both see room for the same member. ``failures_total`` is a counter (exported as
    ``leasekeeper_pool_fill_failures_total``). ``last_error`` never holds a secret: pool
    members have none, and it is the provider's message, cut short."""

    __tablename__ = "pools"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    failures_total: Mapped[int] = mapped_column(Integer, default=0)
    open_until: Mapped[datetime | None]  # the breaker creates nothing before this
    last_error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class TickRun(StrEnum):
    """A beat tick's ``run`` (sweep_ticks.run)."""
    RAN = "ran"
    SKIPPED = "skipped"  # another tick held the single-flight lock
    FAILED = "failed"  # the tick raised (store or Redis down, ...)


class SweepTick(Base):
    """One finished beat tick of a sweep, as its summary said (or its failure). Written by
    the worker's task signals (workers/sweep_ticks.py), trimmed to the newest few per
    sweep; read by the metrics exporter (tailed by id) and the console."""

    __tablename__ = "sweep_ticks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    run: Mapped[str] = mapped_column(String(16))  # ran | skipped | failed
    took_ms: Mapped[int] = mapped_column(Integer, default=0)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    items: Mapped[dict[str, Any]] = mapped_column(default=dict)  # {"items": [...], "error"}
    task_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (Index("ix_sweep_ticks_sweep_id", "sweep", "id"),)


class ProviderErrorClass(StrEnum):
    TRANSIENT = "transient"  # a retry may fix it (providers.errors.is_transient)
    TERMINAL = "terminal"


class ProviderErrorRow(Base):
    """One ProviderError a provider call raised (one per failed part of a destroy): which
    provider, which call, its class and HTTP status (None when it has none). Never its
    message: that could quote a secret. Written at the provider boundary
    (workers/provider_errors.py), trimmed to the newest few; tailed by the exporter."""

    __tablename__ = "provider_errors"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    provider: Mapped[str] = mapped_column(String(64))
    operation: Mapped[str] = mapped_column(String(32))  # acquire, destroy, resume_check, ...
    task: Mapped[str | None] = mapped_column(String(64))  # the Celery task, if in one
    error_class: Mapped[str] = mapped_column(String(16))  # ProviderErrorClass
    status: Mapped[int | None] = mapped_column(Integer)
    error_type: Mapped[str] = mapped_column(String(64))
