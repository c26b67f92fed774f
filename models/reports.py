"""Read-only queries for the operator CLI (`leasekeeper status`, `leases list`, `runs list`).

Every list is bounded (``limit``, ``offset``; newest first) and counted in the same
transaction, so no command ever loads every row. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select

from models.schema import Lease, LeaseState, Run
from models.store import Store

MAX_LIMIT = 1000
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
        if self.provider:
            query = query.where(Lease.provider == self.provider)
        if self.tenant:
            query = query.where(Lease.tenant == self.tenant)
        if self.created_before is not None:
            query = query.where(Lease.created_at < self.created_before)
        if self.pool:
            query = query.where(Lease.pool == self.pool)
        return query


@dataclass(frozen=True)
class Page(Generic[T]):
    rows: list[T]
    total: int
    limit: int
    offset: int

    @property
    def next_offset(self) -> int | None:
        after = self.offset + len(self.rows)
        return after if after < self.total else None


def lease_page(store: Store, where: LeaseFilter, limit: int, offset: int = 0) -> Page[Lease]:
    limit = min(max(limit, 1), MAX_LIMIT)
    with store.tx() as s:
        total = int(s.scalar(where.apply(select(func.count()).select_from(Lease))) or 0)
        rows = list(s.scalars(where.apply(select(Lease))
                              .order_by(Lease.created_at.desc(), Lease.lease_id.desc())
                              .limit(limit).offset(offset)))
    return Page(rows, total, limit, offset)


def run_page(store: Store, statuses: tuple[str, ...], thread_id: str | None, limit: int,
             offset: int = 0) -> Page[Run]:
    limit = min(max(limit, 1), MAX_LIMIT)

    def where(query: Select[Any]) -> Select[Any]:
        if statuses:
            query = query.where(Run.status.in_(statuses))
        if thread_id:
            query = query.where(Run.thread_id == thread_id)
        return query

    with store.tx() as s:
        total = int(s.scalar(where(select(func.count()).select_from(Run))) or 0)
        rows = list(s.scalars(where(select(Run)).order_by(Run.started_at.desc(),
                                                          Run.run_id.desc())
                              .limit(limit).offset(offset)))
    return Page(rows, total, limit, offset)


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
