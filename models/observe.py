"""What operators see, read from the store: counts for the metrics exporter, keyset pages
for the console, the lease event log tailed by id, and the sweep tick log.

Every query here is index-backed (see the indexes in schema.py): counts group on
``ix_leases_state_lease_id_provider_tenant`` / ``ix_runs_status_detached`` over the states
that matter now (not the destroyed / finished history), reclaims are read by
``ix_runs_reclaimed_at``, events of given leases through ``ix_lease_events_lease_id``
(a subquery per lease, never a join the planner could turn into a scan of the log), pages
walk ``lease_id`` (time-ordered) through the primary key or
the ``(state, lease_id)`` / ``(tenant, lease_id)`` prefixes, the event tail walks the
events' primary key. Writes: only
:meth:`Observe.record_tick` (one row per beat tick, trimmed to the newest few per sweep)
and :meth:`Observe.record_provider_errors` (trimmed to the newest few).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, func, insert, select

from models.reports import LeaseFilter as LeaseQuery
from models.reports import Page, lease_page
from models.schema import (
    TERMINAL_RUN_STATUSES,
    Lease,
    LeaseEvent,
    LeaseState,
    ProviderErrorClass,
    ProviderErrorRow,
    Run,
    RunStatus,
    SweepTick,
    utcnow,
)
from models.store import Store

_L = cast(Table, Lease.__table__)
_E = cast(Table, LeaseEvent.__table__)
_R = cast(Table, Run.__table__)
_T = cast(Table, SweepTick.__table__)
_P = cast(Table, ProviderErrorRow.__table__)

WAITING_FOR_CLEANUP = (LeaseState.PENDING_CLEANUP, LeaseState.DESTROYING)
# Every state but destroyed: the leases that matter now, a small slice of the index. The
# destroyed ones are all history (counted by the exporter's transitions counter).
NOT_DESTROYED = tuple(s for s in LeaseState if s != LeaseState.DESTROYED)
UNFINISHED_RUNS = tuple(s for s in RunStatus if s not in TERMINAL_RUN_STATUSES)


@dataclass(frozen=True)
class TailedEvent:
    """One lease event with what the metrics label it by (from its lease row)."""

    id: int
    lease_id: str
    at: datetime
    from_state: str | None
    to_state: str
    provider: str
    backend: str | None
    created_at: datetime  # the lease's intent time
    reason: str
    pool: str | None = None  # the lease's warm pool (a member, or what its run asked for)
    claimed_at: datetime | None = None  # set: a member a run claimed
    run_id: str | None = None  # the lease's run now (none: a pool member no run holds)


@dataclass(frozen=True)
class ErrorRecord:
    """One row of the provider error log, before it is written (no message: see schema)."""

    provider: str
    operation: str
    task: str | None
    error_class: ProviderErrorClass
    status: int | None
    error_type: str


@dataclass(frozen=True)
class LeaseFilter:
    """The console's filter form (one state, age in seconds); the query itself is
    models.reports.LeaseFilter, shared with `leasekeeper leases list`."""

    state: str | None = None
    provider: str | None = None
    tenant: str | None = None
    older_than_s: int | None = None  # created at least this long ago

    def query(self) -> LeaseQuery:
        return LeaseQuery(
            states=(self.state,) if self.state else (), provider=self.provider,
            tenant=self.tenant,
            created_before=(utcnow() - timedelta(seconds=self.older_than_s)
                            if self.older_than_s else None))


class Observe:
    def __init__(self, store: Store) -> None:
        self.store = store

    # -- counts (the exporter's gauges, the console's header) -----------------------------
    def lease_counts(self, states: Sequence[str] = NOT_DESTROYED
                     ) -> list[tuple[str, str, str, int]]:
        """(state, provider, tenant, count) for every combination present in ``states``."""
        with self.store.tx() as s:
            rows = s.execute(select(_L.c.state, _L.c.provider, _L.c.tenant, func.count())
                             .where(_L.c.state.in_(list(states)))
                             .group_by(_L.c.state, _L.c.provider, _L.c.tenant))
            return [(str(a), str(b), str(c), int(n)) for a, b, c, n in rows]

    def counts_by_state(self, states: Sequence[str] = NOT_DESTROYED) -> dict[str, int]:
        with self.store.tx() as s:
            rows = s.execute(select(_L.c.state, func.count())
                             .where(_L.c.state.in_(list(states))).group_by(_L.c.state))
            return {str(state): int(n) for state, n in rows}

    def oldest_cleanup_wait_since(self) -> datetime | None:
        """When the longest-waiting lease still waiting for cleanup (pending_cleanup or
        destroying) first needed it: its earliest ``pending_cleanup`` event.

        Driven from the few waiting leases (the state index), each one's events read through
        ``ix_lease_events_lease_id`` by a correlated subquery: a join let the planner scan
        every event of the history for the pending_cleanup ones and hash them."""
        first = (select(func.min(_E.c.at))
                 .where(_E.c.lease_id == _L.c.lease_id,
                        _E.c.to_state == LeaseState.PENDING_CLEANUP)
                 .correlate(_L).scalar_subquery())
        waiting = (select(first.label("first")).where(_L.c.state.in_(WAITING_FOR_CLEANUP))
                   .subquery())
        with self.store.tx() as s:
            value = s.scalar(select(func.min(waiting.c.first)))
        return cast(datetime | None, value)

    def run_counts(self, statuses: Sequence[str] = UNFINISHED_RUNS) -> dict[str, int]:
        with self.store.tx() as s:
            rows = s.execute(select(_R.c.status, func.count())
                             .where(_R.c.status.in_(list(statuses))).group_by(_R.c.status))
            return {str(status): int(n) for status, n in rows}

    def reclaims_since(self, moment: datetime) -> list[tuple[str, str, datetime]]:
        """(run_id, outcome, reclaimed_at) of reclaims recorded at or after ``moment``."""
        with self.store.tx() as s:
            rows = s.execute(select(_R.c.run_id, _R.c.reclaim_outcome, _R.c.reclaimed_at)
                             .where(_R.c.reclaimed_at >= moment,
                                    _R.c.reclaim_outcome.is_not(None))
                             .order_by(_R.c.reclaimed_at))
            return [(str(a), str(b), c) for a, b, c in rows]

    # -- the event log, tailed by id --------------------------------------------------
    def max_event_id(self) -> int:
        with self.store.tx() as s:
            return int(s.scalar(select(func.max(_E.c.id))) or 0)

    def events_from(self, first_id: int, limit: int) -> list[TailedEvent]:
        """Events with ``id >= first_id`` in id order, joined to their lease's labels."""
        with self.store.tx() as s:
            rows = s.execute(
                select(_E.c.id, _E.c.lease_id, _E.c.at, _E.c.from_state, _E.c.to_state,
                       _L.c.provider, _L.c.backend, _L.c.created_at, _E.c.reason,
                       _L.c.pool, _L.c.claimed_at, _L.c.run_id)
                .select_from(_E.join(_L, _L.c.lease_id == _E.c.lease_id))
                .where(_E.c.id >= first_id).order_by(_E.c.id).limit(limit))
            return [TailedEvent(*row) for row in rows]

    def last_entered(self, lease_ids: Sequence[str], state: str, before_id: int
                     ) -> dict[str, datetime]:
        """For each lease, when it last entered ``state`` in an event before ``before_id``."""
        if not lease_ids:
            return {}
        # Each lease's own events through ix_lease_events_lease_id (a correlated subquery per
        # lease, by primary key): never a scan of the log, whatever its statistics say.
        last = (select(func.max(_E.c.at))
                .where(_E.c.lease_id == _L.c.lease_id, _E.c.to_state == state,
                       _E.c.id < before_id)
                .correlate(_L).scalar_subquery())
        with self.store.tx() as s:
            rows = s.execute(select(_L.c.lease_id, last)
                             .where(_L.c.lease_id.in_(list(lease_ids))))
            return {str(lease_id): at for lease_id, at in rows if at is not None}

    # -- the sweep tick log -------------------------------------------------------------
    def record_tick(self, sweep: str, run: str, took_ms: int, counts: dict[str, Any],
                    items: dict[str, Any], task_id: str | None, keep: int) -> None:
        with self.store.tx() as s:
            s.execute(insert(_T).values(sweep=sweep, at=utcnow(), run=run, took_ms=took_ms,
                                        counts=counts, items=items, task_id=task_id))
            cutoff = (select(_T.c.id).where(_T.c.sweep == sweep).order_by(_T.c.id.desc())
                      .offset(keep).limit(1).scalar_subquery())
            s.execute(delete(_T).where(_T.c.sweep == sweep, _T.c.id <= cutoff))

    def last_ticks(self) -> list[tuple[str, str, datetime]]:
        """(sweep, run, at) of the newest tick of each sweep and kind of run."""
        with self.store.tx() as s:
            rows = s.execute(select(_T.c.sweep, _T.c.run, func.max(_T.c.at))
                             .group_by(_T.c.sweep, _T.c.run))
            return [(str(a), str(b), c) for a, b, c in rows]

    def ticks_from(self, first_id: int, limit: int) -> list[SweepTick]:
        with self.store.tx() as s:
            return list(s.scalars(select(SweepTick).where(SweepTick.id >= first_id)
                                  .order_by(SweepTick.id).limit(limit)))

    def max_tick_id(self) -> int:
        with self.store.tx() as s:
            return int(s.scalar(select(func.max(_T.c.id))) or 0)

    def recent_ticks(self, sweep: str, limit: int) -> list[SweepTick]:
        with self.store.tx() as s:
            return list(s.scalars(select(SweepTick).where(SweepTick.sweep == sweep)
                                  .order_by(SweepTick.id.desc()).limit(limit)))

    # -- the provider error log ------------------------------------------------------------
    def record_provider_errors(self, records: Sequence[ErrorRecord], keep: int) -> None:
        if not records:
            return
        with self.store.tx() as s:
            s.execute(insert(_P), [{"at": utcnow(), "provider": r.provider,
                                    "operation": r.operation, "task": r.task,
                                    "error_class": r.error_class, "status": r.status,
                                    "error_type": r.error_type[:64]} for r in records])
            cutoff = (select(_P.c.id).order_by(_P.c.id.desc()).offset(keep).limit(1)
                      .scalar_subquery())
            s.execute(delete(_P).where(_P.c.id <= cutoff))

    def provider_errors_from(self, first_id: int, limit: int) -> list[ProviderErrorRow]:
        with self.store.tx() as s:
            return list(s.scalars(select(ProviderErrorRow)
                                  .where(ProviderErrorRow.id >= first_id)
                                  .order_by(ProviderErrorRow.id).limit(limit)))

    def max_provider_error_id(self) -> int:
        with self.store.tx() as s:
            return int(s.scalar(select(func.max(_P.c.id))) or 0)

    # -- the console's pages --------------------------------------------------------------
    def lease_page(self, flt: LeaseFilter, before: str | None, limit: int,
                   counted: bool = False) -> Page[Lease]:
        """Newest first, ``limit`` leases with ``lease_id < before``: the CLI's listing
        (models/reports.py); uncounted unless ``counted`` (the leases page shows counts by
        state instead; "needs attention" counts each state's, capped like the CLI's)."""
        return lease_page(self.store, flt.query(), limit, before, counted=counted)
