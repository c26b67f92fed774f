"""The sweeps' reads and claims over the lease store.

Every sweep decides first and then claims: a ``due_*`` read (what a tick, or a dry run,
would act on; bounded, oldest first) and a ``claim_*`` that takes exactly those ids again
in one short transaction, re-checking every condition in the guarded UPDATE (so a viewer
that came back, a lease touched meanwhile, or another tick that won, is left alone).
On PostgreSQL the claim first locks the candidate rows with ``FOR UPDATE SKIP LOCKED``, so
overlapping ticks split the work instead of queueing on each other; on SQLite the write
transaction (``BEGIN IMMEDIATE``) serialises them. Every lease state change appends its
LeaseEvent in the same transaction, as everywhere in the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    String,
    Table,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models.rawsql import Change, SessionCursor
from models.schema import (
    FINAL_STATES,
    TERMINAL_RUN_STATUSES,
    Lease,
    LeaseEvent,
    LeaseState,
    Run,
    RunStatus,
    utcnow,
)
from models.store import UNFINISHED_RUN_STATUSES, Store, failed_run, leaseless

L = cast(Table, Lease.__table__)
E = cast(Table, LeaseEvent.__table__)
R = cast(Table, Run.__table__)
_CHUNK = 500


@dataclass(frozen=True)
class Expiry:
    lease_id: str
    kind: str  # "expired" (absolute deadline) or "idle" (idle deadline)


@dataclass(frozen=True)
class Orphan:
    """A provider resource that no lease row knows, to be recorded for cleanup."""

    provider: str
    name: str
    backend: str
    lease_id: str | None  # from the resource's label, when it has one
    meta: dict[str, Any]
    tenant: str
    reason: str

    @property
    def row_id(self) -> str:
        """The lease id of its row: its own label, or a stable id derived from the name."""
        if self.lease_id:
            return self.lease_id[:64]
        digest = hashlib.sha256(f"{self.provider}:{self.name}".encode()).hexdigest()[:40]
        return f"orphan-{digest}"


@dataclass(frozen=True)
class LeaseIndex:
    by_name: dict[str, Lease]
    by_id: dict[str, Lease]

    def add(self, lease: Lease) -> None:
        """Where several rows share a name, one not final wins, then the newest."""
        self.by_id[lease.lease_id] = lease
        held = self.by_name.get(lease.provider_lease_id)
        if held is None or held.state in FINAL_STATES:
            self.by_name[lease.provider_lease_id] = lease

    def lookup(self, name: str, lease_id: str | None) -> Lease | None:
        return self.by_name.get(name) or (self.by_id.get(lease_id) if lease_id else None)


def move(s: Session, store: Store, lease_id: str, frm: str, to: LeaseState, reason: str,
         task_id: str | None, guard: str, guard_params: dict[str, Any], **values: Any) -> bool:
    """One guarded state change inside ``s`` (the store's own plain-SQL transition, on the
    session's connection: the same statements as every task's); True if this caller won.
    ``guard`` is an extra SQL condition over the lease row, with ``guard_params``."""
    cursor = SessionCursor(s.connection())
    change = Change(lease_id, frozenset({frm}), to, reason, task_id, values,
                    guard=guard, guard_params=guard_params)
    return store.raw.transition(cursor, change, utcnow()) is not None


LEASELESS_ERROR = ("its acquire never recorded a lease (the acquire gave up, or its message "
                   "was lost); no sandbox was made for it: start a new run")


class SweepStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._skip_locked = store.engine.dialect.name == "postgresql"

    def _lock(self, s: Session, table: Table, key: Any, ids: Sequence[str],
              *conditions: ColumnElement[bool]) -> list[str]:
        """The ids still matching ``conditions``, row-locked (skipping locked) on PostgreSQL,
        in the order given (the due read's: oldest first), not the index's."""
        query = select(key).where(key.in_(list(ids)), *conditions)
        if self._skip_locked:
            query = query.with_for_update(skip_locked=True)
        matching = set(s.scalars(query))
        return [i for i in ids if i in matching]

    # -- sweep.reap_runs ---------------------------------------------------------------
    @staticmethod
    def _detached(cutoff: datetime) -> list[ColumnElement[bool]]:
        # Interrupted (paused) runs too: not terminal, they hold their sandbox as a running
        # one does; an IN list of the index's first column keeps the read on it.
        return [R.c.status.in_([RunStatus.RUNNING, RunStatus.INTERRUPTED]),
                R.c.detached_since.is_not(None),
                R.c.detached_since <= cutoff]

    def due_detached_runs(self, cutoff: datetime, limit: int) -> list[str]:
        """Running or interrupted runs detached at or before ``cutoff`` (inclusive), longest
        detached first."""
        with self.store.tx() as s:
            return list(s.scalars(select(R.c.run_id).where(*self._detached(cutoff))
                                  .order_by(R.c.detached_since).limit(limit)))

    def claim_detached_runs(self, run_ids: Sequence[str], cutoff: datetime,
                            claim_s: float) -> list[tuple[str, bool]]:
        """Abort these runs if still detached past the cutoff; record cancel intent first.

        Returns (run id, reclaim due) for each run this call aborted. As after run.finish,
        a run of a reused sandbox is not due for reclaim: the sandbox outlives its runs.
        """
        now = utcnow()
        aborted: list[tuple[str, bool]] = []
        with self.store.tx() as s:
            for run_id in self._lock(s, R, R.c.run_id, run_ids, *self._detached(cutoff)):
                reused = bool(s.scalar(select(L.c.reuse).select_from(R.join(
                    L, L.c.lease_id == R.c.lease_id)).where(R.c.run_id == run_id)))
                row = s.execute(
                    update(R).where(R.c.run_id == run_id, *self._detached(cutoff))
                    .values(status=RunStatus.ABORTED, finished_at=now, cancel_requested=True,
                            error="detached past its TTL", reclaim_due=not reused,
                            reclaim_claimed_until=now + timedelta(seconds=claim_s))
                    .returning(R.c.run_id)).one_or_none()
                if row is not None:
                    aborted.append((run_id, not reused))
        return aborted

    @staticmethod
    def _unreclaimed(now: datetime) -> list[ColumnElement[bool]]:
        return [R.c.status.in_(list(TERMINAL_RUN_STATUSES)), R.c.reclaim_due.is_(True),
                R.c.reclaim_outcome.is_(None),
                or_(R.c.reclaim_claimed_until.is_(None), R.c.reclaim_claimed_until <= now)]

    def due_reclaims(self, now: datetime, limit: int) -> list[str]:
        """Terminal runs due for reclaim with no live claim (theirs was lost), oldest first."""
        with self.store.tx() as s:
            return list(s.scalars(select(R.c.run_id).where(*self._unreclaimed(now))
                                  .order_by(R.c.finished_at).limit(limit)))

    def claim_reclaims(self, run_ids: Sequence[str], now: datetime, claim_s: float) -> list[str]:
        with self.store.tx() as s:
            ids = self._lock(s, R, R.c.run_id, run_ids, *self._unreclaimed(now))
            return [run_id for run_id in ids if s.execute(
                update(R).where(R.c.run_id == run_id, *self._unreclaimed(now))
                .values(reclaim_claimed_until=now + timedelta(seconds=claim_s))
                .returning(R.c.run_id)).one_or_none() is not None]

    @staticmethod
    def _on_ended_lease() -> list[ColumnElement[bool]]:
        # The statuses as literals, not parameters: the predicate of the partial index
        # ix_runs_unfinished_started, which only a literal match lets the planners
        # (SQLite's always, PostgreSQL's in a generic plan) use.
        unfinished = [literal(str(s), String, literal_execute=True)
                      for s in UNFINISHED_RUN_STATUSES]
        return [R.c.status.in_(unfinished), L.c.state.in_(list(FINAL_STATES))]

    def due_runs_on_ended_leases(self, limit: int) -> list[str]:
        """Runs still running or interrupted whose own lease has ended (destroyed or
        abandoned) without settling them (a lost write, or rows from before that rule)."""
        with self.store.tx() as s:
            return list(s.scalars(
                select(R.c.run_id).select_from(R.join(L, L.c.lease_id == R.c.lease_id))
                .where(*self._on_ended_lease()).order_by(R.c.started_at).limit(limit)))

    def settle_runs_on_ended_leases(self, run_ids: Sequence[str]) -> list[str]:
        """Abort each of these runs still unfinished on an ended lease, with the lease's end
        reason, as the lease's end would have; returns the ids this call settled."""
        settled: list[str] = []
        joined = R.join(L, L.c.lease_id == R.c.lease_id)
        with self.store.tx() as s:
            query = (select(R.c.run_id, L.c.lease_id, L.c.state, L.c.end_reason)
                     .select_from(joined)
                     .where(R.c.run_id.in_(list(run_ids)), *self._on_ended_lease()))
            if self._skip_locked:
                query = query.with_for_update(of=R, skip_locked=True)
            for run_id, lease_id, state, end_reason in s.execute(query).all():
                row = s.execute(
                    update(R).where(R.c.run_id == run_id, R.c.lease_id == lease_id,
                                    R.c.status.in_(list(UNFINISHED_RUN_STATUSES)))
                    .values(status=RunStatus.ABORTED, finished_at=utcnow(), reclaim_due=False,
                            reclaim_claimed_until=None,
                            error=f"its lease {lease_id} ended: {end_reason or state}")
                    .returning(R.c.run_id)).one_or_none()
                if row is not None:
                    settled.append(run_id)
        return settled

    def due_leaseless_runs(self, cutoff: datetime, limit: int) -> list[str]:
        """Runs still running with no lease, started at or before ``cutoff``: their acquire
        gave up or its message was lost before it recorded a lease (partial index
        ix_runs_leaseless: it holds only such runs)."""
        with self.store.tx() as s:
            return list(s.scalars(select(R.c.run_id).where(*leaseless(cutoff))
                                  .order_by(R.c.started_at).limit(limit)))

    def fail_leaseless_runs(self, run_ids: Sequence[str], cutoff: datetime) -> list[str]:
        """Fail each of these runs still running with no lease since ``cutoff`` (guarded:
        one an acquire binds a lease to meanwhile is left alone); the ids failed."""
        failed: list[str] = []
        with self.store.tx() as s:
            for run_id in self._lock(s, R, R.c.run_id, run_ids, *leaseless(cutoff)):
                row = s.execute(
                    update(R).where(R.c.run_id == run_id, *leaseless(cutoff))
                    .values(**failed_run(LEASELESS_ERROR))
                    .returning(R.c.run_id)).one_or_none()
                if row is not None:
                    failed.append(run_id)
        return failed

    # -- sweep.expire_leases -----------------------------------------------------------
    @staticmethod
    def _past_deadline(now: datetime) -> ColumnElement[bool]:
        return or_(L.c.deadline_at <= now, L.c.idle_deadline_at <= now)

    def due_expiries(self, now: datetime, limit: int) -> list[Expiry]:
        """Active leases at or past their absolute or idle deadline, most overdue first."""
        idle = func.coalesce(L.c.idle_deadline_at, L.c.deadline_at)
        # The earlier of the two deadlines: least() on PostgreSQL, scalar min() on SQLite.
        first_due: ColumnElement[Any] = (func.least(L.c.deadline_at, idle) if self._skip_locked
                                         else func.min(L.c.deadline_at, idle))
        with self.store.tx() as s:
            rows = s.execute(select(L.c.lease_id, L.c.deadline_at).where(
                L.c.state == LeaseState.ACTIVE, self._past_deadline(now))
                .order_by(first_due, L.c.lease_id).limit(limit)).all()
        return [Expiry(lid, "expired" if deadline <= now else "idle") for lid, deadline in rows]

    def claim_expiries(self, lease_ids: Sequence[str], now: datetime, claim_s: float,
                       task_id: str | None) -> list[Expiry]:
        """active → pending_cleanup for each lease still past a deadline (a lease touched
        since ``due_expiries`` is left alone); its destroy is claimed for ``claim_s``."""
        claimed: list[Expiry] = []
        past = self._past_deadline(now)
        with self.store.tx() as s:
            ids = self._lock(s, L, L.c.lease_id, lease_ids, L.c.state == LeaseState.ACTIVE, past)
            for lease_id in ids:
                deadline = s.scalar(select(L.c.deadline_at).where(L.c.lease_id == lease_id))
                kind = "expired" if deadline is not None and deadline <= now else "idle"
                what = "absolute deadline" if kind == "expired" else "idle timeout"
                if move(s, self.store, lease_id, LeaseState.ACTIVE, LeaseState.PENDING_CLEANUP,
                        f"{kind}: past its {what} (sweep.expire_leases)", task_id,
                        "deadline_at <= :g_now OR idle_deadline_at <= :g_now",
                        {"g_now": self.store.raw.time(now)}, end_reason=kind,
                        next_cleanup_at=now + timedelta(seconds=claim_s)):
                    claimed.append(Expiry(lease_id, kind))
        return claimed

    # -- sweep.retry_cleanup -----------------------------------------------------------
    def due_stale_destroys(self, now: datetime, limit: int, claim_s: float) -> list[str]:
        """Leases left in destroying longer than a destroy claim (the worker died)."""
        with self.store.tx() as s:
            return list(s.scalars(select(L.c.lease_id).where(
                L.c.state == LeaseState.DESTROYING,
                L.c.updated_at <= now - timedelta(seconds=claim_s))
                .order_by(L.c.updated_at).limit(limit)))

    def recover_stale_destroys(self, lease_ids: Sequence[str], now: datetime, claim_s: float,
                               max_attempts: int, task_id: str | None
                               ) -> list[tuple[str, LeaseState]]:
        """A destroy whose worker died counts as a failed attempt: back to pending_cleanup
        (due now), or abandoned once that reaches the cap."""
        stale = L.c.updated_at <= now - timedelta(seconds=claim_s)
        moved: list[tuple[str, LeaseState]] = []
        with self.store.tx() as s:
            for lease_id in self._lock(s, L, L.c.lease_id, lease_ids,
                                       L.c.state == LeaseState.DESTROYING, stale):
                attempts = int(s.scalar(select(L.c.cleanup_attempts)
                                        .where(L.c.lease_id == lease_id)) or 0) + 1
                if attempts >= max_attempts:
                    to, reason = LeaseState.ABANDONED, (
                        f"destroy claim expired (the worker died?); attempt {attempts} of "
                        f"{max_attempts}: left for an operator")
                    extra: dict[str, Any] = {"next_cleanup_at": None,
                                             "last_error": "destroy claim expired"}
                else:
                    to, reason = LeaseState.PENDING_CLEANUP, (
                        f"destroy claim expired (the worker died?); attempt {attempts} of "
                        f"{max_attempts}")
                    extra = {"next_cleanup_at": now}
                if move(s, self.store, lease_id, LeaseState.DESTROYING, to, reason, task_id,
                        "updated_at <= :g_cutoff",
                        {"g_cutoff": self.store.raw.time(now - timedelta(seconds=claim_s))},
                        cleanup_attempts=attempts, **extra):
                    moved.append((lease_id, to))
        return moved

    @staticmethod
    def _cleanup_due(now: datetime) -> list[ColumnElement[bool]]:
        return [L.c.state == LeaseState.PENDING_CLEANUP,
                or_(L.c.next_cleanup_at.is_(None), L.c.next_cleanup_at <= now)]

    def due_cleanups(self, now: datetime, limit: int) -> list[str]:
        """pending_cleanup leases whose next attempt is due, oldest lease first."""
        with self.store.tx() as s:
            return list(s.scalars(select(L.c.lease_id).where(*self._cleanup_due(now))
                                  .order_by(L.c.created_at, L.c.lease_id).limit(limit)))

    def claim_cleanups(self, lease_ids: Sequence[str], now: datetime, claim_s: float
                       ) -> list[str]:
        """Claim each for one destroy attempt: its next attempt moves ``claim_s`` ahead, so
        no other tick takes it while the destroy it gets is in flight."""
        with self.store.tx() as s:
            ids = self._lock(s, L, L.c.lease_id, lease_ids, *self._cleanup_due(now))
            return [lease_id for lease_id in ids if s.execute(
                update(L).where(L.c.lease_id == lease_id, *self._cleanup_due(now))
                .values(next_cleanup_at=now + timedelta(seconds=claim_s))
                .returning(L.c.lease_id)).one_or_none() is not None]

    def count_in_state(self, state: LeaseState) -> int:
        with self.store.tx() as s:
            return int(s.scalar(select(func.count()).where(L.c.state == state)) or 0)

    # -- sweep.stuck_provisioning ------------------------------------------------------
    @staticmethod
    def _stuck(now: datetime) -> list[ColumnElement[bool]]:
        return [L.c.state == LeaseState.PROVISIONING, L.c.acquire_deadline_at <= now]

    def due_stuck(self, now: datetime, limit: int) -> list[Lease]:
        """Leases still provisioning at or past their acquire deadline, oldest first."""
        with self.store.tx() as s:
            return list(s.scalars(select(Lease).where(
                Lease.state == LeaseState.PROVISIONING, Lease.acquire_deadline_at <= now)
                .order_by(Lease.acquire_deadline_at, Lease.lease_id).limit(limit)))

    def claim_stuck(self, lease_ids: Sequence[str], now: datetime, claim_s: float) -> list[str]:
        """Claim each for one reconciliation by moving its acquire deadline ``claim_s``
        ahead (no state change yet: adopt or destroy is decided under the claim)."""
        with self.store.tx() as s:
            ids = self._lock(s, L, L.c.lease_id, lease_ids, *self._stuck(now))
            return [lease_id for lease_id in ids if s.execute(
                update(L).where(L.c.lease_id == lease_id, *self._stuck(now))
                .values(acquire_deadline_at=now + timedelta(seconds=claim_s))
                .returning(L.c.lease_id)).one_or_none() is not None]

    # -- sweep.orphans -----------------------------------------------------------------
    def leases_for(self, provider: str, names: Sequence[str], lease_ids: Sequence[str]
                   ) -> LeaseIndex:
        """The lease rows of these provider resources, by resource name and by the lease
        id their labels carry."""
        index = LeaseIndex({}, {})
        with self.store.tx() as s:
            for start in range(0, max(len(names), len(lease_ids)), _CHUNK):
                rows = s.scalars(select(Lease).where(Lease.provider == provider, or_(
                    Lease.provider_lease_id.in_(list(names[start:start + _CHUNK])),
                    Lease.lease_id.in_(list(lease_ids[start:start + _CHUNK])),
                )).order_by(Lease.created_at))
                for lease in rows:
                    index.add(lease)
        return index

    def record_orphan(self, orphan: Orphan, now: datetime, claim_s: float,
                      task_id: str | None) -> str | None:
        """Insert the orphan as a pending_cleanup lease row (its destroy claimed for
        ``claim_s``) with its event; None if a row with its id exists (another tick won)."""
        lease_id = orphan.row_id
        try:
            with self.store.tx() as s:
                s.execute(insert(L).values(
                    lease_id=lease_id, sandbox_key=f"orphan:{orphan.provider}:{orphan.name}"[:128],
                    live_key=None, provider=orphan.provider, provider_lease_id=orphan.name,
                    backend=orphan.backend, provider_meta=orphan.meta,
                    state=LeaseState.PENDING_CLEANUP, reuse=False, tenant=orphan.tenant[:64],
                    thread_id=None, run_id=None, spec={}, created_at=now, updated_at=now,
                    acquire_deadline_at=now, deadline_at=now, idle_timeout_s=0,
                    cleanup_attempts=0, next_cleanup_at=now + timedelta(seconds=claim_s),
                    end_reason="orphan", version=1))
                s.execute(insert(E).values(lease_id=lease_id, at=now, from_state=None,
                                           to_state=LeaseState.PENDING_CLEANUP,
                                           reason=orphan.reason[:2000], task_id=task_id))
        except IntegrityError:
            return None
        return lease_id

    def revive(self, lease_id: str, listed_at: datetime, reason: str, now: datetime,
               claim_s: float, max_attempts: int, task_id: str | None,
               found: dict[str, Any] | None = None) -> LeaseState | None:
        """A destroyed lease whose resource is still listed after the destroy was recorded
        goes back to pending_cleanup; the destroy that did not take counts as a failed
        attempt, so a resource that keeps coming back ends abandoned, not in a loop.
        ``found`` (``backend``, ``provider_meta``) is what the listing says the resource is
        now, so the next destroy aims at what is really there."""
        destroyed_before = L.c.updated_at < listed_at
        with self.store.tx() as s:
            attempts = s.scalar(select(L.c.cleanup_attempts).where(
                L.c.lease_id == lease_id, L.c.state == LeaseState.DESTROYED, destroyed_before))
            if attempts is None:
                return None
            attempts = int(attempts) + 1
            if attempts >= max_attempts:
                to = LeaseState.ABANDONED
                extra: dict[str, Any] = {"next_cleanup_at": None}
                reason = f"{reason}; attempt {attempts} of {max_attempts}: left for an operator"
            else:
                to = LeaseState.PENDING_CLEANUP
                extra = {"next_cleanup_at": now + timedelta(seconds=claim_s)}
            won = move(s, self.store, lease_id, LeaseState.DESTROYED, to, reason, task_id,
                       "updated_at < :g_listed_at",
                       {"g_listed_at": self.store.raw.time(listed_at)},
                       cleanup_attempts=attempts, last_error="resource still present after "
                       "its destroy", **(found or {}), **extra)
        return to if won else None
