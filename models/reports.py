"""Read-only queries for the operator CLI and the console (`leasekeeper status`, `leases
list`, `runs list`, the console's lease pages).

Every list is a keyset page, newest first: ``limit`` rows (at most MAX_LIMIT) after the
last row of the previous page, named by its id (``before``), never an offset, so the
hundredth page costs what the first does at any history size. Leases are listed by id
(lease ids begin with their creation time in milliseconds: models/schema.py), runs by
``(started_at, run_id)``. The total is counted in the same transaction up to COUNT_CAP
rows (``total_capped`` says there are more): an exact count of a million-row history
would cost more than the page. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, literal, select, tuple_
from sqlalchemy.orm import Session

from models.schema import Lease, LeaseState, Run
from models.store import Store
from providers.errors import NotFound

MAX_LIMIT = 1000
COUNT_CAP = 10_000
T = TypeVar("T")


@dataclass(frozen=True)
class LeaseFilter:
    states: tuple[str, ...] = ()
    provider: str | None = None
    tenant: str | None = None
    created_before: datetime | None = None  # --older-than
    pool: str | None = None

    def apply(self, query: Select[Any]) -> Select[Any]:
        if self.states:
            query = query.where(Lease.state.in_(self.states))
        # None is no filter; any string (an empty one too) is compared, never dropped
        if self.provider is not None:
            query = query.where(Lease.provider == self.provider)
        if self.tenant is not None:
            query = query.where(Lease.tenant == self.tenant)
        if self.created_before is not None:
            query = query.where(Lease.created_at < self.created_before)
        if self.pool is not None:
            query = query.where(Lease.pool == self.pool)
        return query


@dataclass(frozen=True)
class Page(Generic[T]):
    rows: list[T]
    limit: int
    total: int  # rows matching the filter, counted up to COUNT_CAP
    total_capped: bool  # more than COUNT_CAP match
    next_before: str | None  # the id to pass as ``before`` for the next page

    @property
    def total_text(self) -> str:
        return f"{self.total:,}+" if self.total_capped else f"{self.total:,}"


def _capped_count(s: Session, matching: Select[Any]) -> tuple[int, bool]:
    """How many rows ``matching`` selects, counted up to COUNT_CAP (and whether more)."""
    limited = matching.limit(COUNT_CAP + 1).subquery()
    found = int(s.scalar(select(func.count()).select_from(limited)) or 0)
    return min(found, COUNT_CAP), found > COUNT_CAP


def _limit(limit: int) -> int:
    return min(max(limit, 1), MAX_LIMIT)


def lease_page(store: Store, where: LeaseFilter, limit: int, before: str | None = None,
               counted: bool = True) -> Page[Lease]:
    """Leases matching ``where``, newest first, ``limit`` of them with an id below
    ``before`` (the previous page's ``next_before``); ``counted=False`` skips the total."""
    limit = _limit(limit)
    query = where.apply(select(Lease)).order_by(Lease.lease_id.desc()).limit(limit + 1)
    if before is not None:
        query = query.where(Lease.lease_id < before)
    with store.tx() as s:
        rows = list(s.scalars(query))
        # counted in the page's order, so the count walks the page's index too (a
        # tenant's (tenant, lease_id)), never a scan of the table or of another index
        total, capped = (_capped_count(s, where.apply(select(literal(1)).select_from(Lease))
                                       .order_by(Lease.lease_id.desc()))
                         if counted else (0, False))
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, limit, total, capped, rows[-1].lease_id if more else None)


def run_page(store: Store, statuses: tuple[str, ...], thread_id: str | None, limit: int,
             before: str | None = None) -> Page[Run]:
    """Runs, newest first (by start), ``limit`` of them started before the run
    ``before`` (the previous page's ``next_before``); NotFound if there is no such run."""
    limit = _limit(limit)

    def where(query: Select[Any]) -> Select[Any]:
        if statuses:
            query = query.where(Run.status.in_(statuses))
        if thread_id is not None:
            query = query.where(Run.thread_id == thread_id)
        return query

    query = where(select(Run)).order_by(Run.started_at.desc(), Run.run_id.desc())
    with store.tx() as s:
        if before is not None:
            started = s.scalar(select(Run.started_at).where(Run.run_id == before))
            if started is None:
                raise NotFound(f"no run {before[:64]!r} to list runs before; pass the run id "
                               "the previous page named (--before)")
            query = query.where(tuple_(Run.started_at, Run.run_id) < tuple_(started, before))
        rows = list(s.scalars(query.limit(limit + 1)))
        total, capped = _capped_count(s, where(select(literal(1)).select_from(Run)))
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, limit, total, capped, rows[-1].run_id if more else None)


@dataclass(frozen=True)
class Overview:
    """What `leasekeeper status` shows from the store."""

    leases: dict[str, dict[str, int]]  # state -> provider -> count
    runs: dict[str, int]  # status -> count
    abandoned: list[Lease]  # newest first, at most ``abandoned_limit``
    abandoned_total: int
    oldest_pending_cleanup: Lease | None


def overview(store: Store, abandoned_limit: int = 10) -> Overview:
    leases: dict[str, dict[str, int]] = {}
    with store.tx() as s:
        for state, provider, count in s.execute(
                select(Lease.state, Lease.provider, func.count())
                .group_by(Lease.state, Lease.provider)):
            leases.setdefault(state, {})[provider] = int(count)
        runs = {status: int(count) for status, count in s.execute(
            select(Run.status, func.count()).group_by(Run.status))}
        abandoned = list(s.scalars(select(Lease).where(Lease.state == LeaseState.ABANDONED)
                                   .order_by(Lease.updated_at.desc()).limit(abandoned_limit)))
        oldest = s.scalar(select(Lease).where(Lease.state == LeaseState.PENDING_CLEANUP)
                          .order_by(Lease.updated_at).limit(1))
    total = sum(leases.get(LeaseState.ABANDONED, {}).values())
    return Overview(leases, runs, abandoned, total, oldest)


def lease_ids_starting(store: Store, prefix: str, limit: int = 2) -> list[str]:
    """Lease ids that start with ``prefix`` (at most ``limit``), to resolve a short id."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    with store.tx() as s:
        return list(s.scalars(select(Lease.lease_id)
                              .where(Lease.lease_id.like(f"{escaped}%", escape="\\"))
                              .order_by(Lease.lease_id).limit(limit)))
