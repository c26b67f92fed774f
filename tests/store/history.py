"""A realistic lease history on PostgreSQL, bulk-loaded with generate_series, and the sweep
reads it makes due: for the EXPLAIN test (tests/store/test_sweep_plans.py) and
bench/sweeps.py.

Of every 1,000 leases: 980 destroyed (their runs completed and reclaimed), 10 active (runs
running), 3 provisioning, 3 pending_cleanup, 2 destroying, 2 abandoned (runs failed). Rows
are created one second apart up to ``NOW``; 30 more runs, a day old, never got a lease.
What a sweep finds due does not grow with the history (the sweeps keep up): about 30 rows
per sweep in any history of 15,000 rows or more (fewer below), the rest of each state not
due yet. Ten runs (one per 1,000 leases, up to ten) are still running or interrupted on a
destroyed lease: a lost write that sweep.reap_runs settles. Every lease has its events, one
per state it went through (about five a lease: the exporter reads them at each scrape), so
the leases waiting for cleanup have a pending_cleanup event, as do the ones destroyed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from models.observe import Observe
from models.pool_store import PoolStore
from models.rawsql import SessionCursor
from models.reports import LeaseFilter, lease_page, run_page
from models.schema import LeaseState, RunStatus
from models.store import Store
from models.sweep_store import Orphan, SweepStore

NOW = datetime(2026, 6, 1, 12, 0, 0)
DETACH_TTL = timedelta(minutes=30)

_LEASES = """
INSERT INTO leases (lease_id, sandbox_key, live_key, provider, provider_lease_id, backend,
    provider_meta, state, reuse, tenant, thread_id, run_id, spec, created_at, updated_at,
    ready_at, acquire_deadline_at, deadline_at, idle_timeout_s, idle_deadline_at,
    cleanup_attempts, next_cleanup_at, end_reason, last_error, version)
SELECT 'l' || lpad(i::text, 10, '0'), 'key-' || i,
    CASE WHEN st IN ('active', 'provisioning') THEN 'key-' || i END,
    'noop', 'lk-l' || lpad(i::text, 10, '0'), 'none', '{}', st, false, 'default',
    't-' || (i % 5000), 'r' || lpad(i::text, 10, '0'), '{}', created,
    CASE st WHEN 'destroying' THEN (CASE WHEN k < 15 THEN :now - interval '1 hour'
                                         ELSE :now - interval '10 seconds' END)
            ELSE created + interval '60 seconds' END,
    created + interval '1 second',
    CASE WHEN st = 'provisioning' THEN (CASE WHEN k < 10 THEN :now - interval '1 hour'
                                             ELSE :now + interval '100 seconds' END)
         ELSE created + interval '120 seconds' END,
    CASE WHEN st = 'active' THEN (CASE WHEN k < 3 THEN :now - interval '1 minute'
                                       ELSE :now + interval '1 hour' END)
         ELSE created + interval '1 hour' END,
    900,
    CASE WHEN st = 'active' THEN :now + interval '10 minutes' END,
    CASE WHEN st = 'abandoned' THEN 5 ELSE 0 END,
    CASE WHEN st = 'pending_cleanup' THEN (CASE WHEN k < 10 THEN :now - interval '1 minute'
                                                ELSE :now + interval '5 minutes' END) END,
    CASE WHEN st IN ('destroyed', 'abandoned', 'pending_cleanup') THEN 'requested' END,
    CASE WHEN st = 'abandoned' THEN 'injected' END, 3
FROM (SELECT i, i / 1000 AS k, :now - make_interval(secs => :n - i) AS created,
             CASE WHEN i % 1000 < 980 THEN 'destroyed'
                  WHEN i % 1000 < 990 THEN 'active'
                  WHEN i % 1000 < 993 THEN 'provisioning'
                  WHEN i % 1000 < 996 THEN 'pending_cleanup'
                  WHEN i % 1000 < 998 THEN 'destroying'
                  ELSE 'abandoned' END AS st
      FROM generate_series(1, :n) AS i) AS g
"""

_RUNS = """
INSERT INTO runs (run_id, thread_id, status, exit_code, provider, sandbox_key, lease_id,
    started_at, finished_at, detached_since, cancel_requested, error, reclaim_due,
    reclaim_claimed_until, reclaim_outcome, reclaimed_at)
SELECT l.run_id, l.thread_id,
    CASE WHEN l.state IN ('active', 'provisioning') THEN 'running'
         WHEN l.state = 'destroyed' THEN 'completed' ELSE 'failed' END,
    CASE WHEN l.state = 'destroyed' THEN 0 WHEN l.state IN ('active', 'provisioning')
         THEN NULL ELSE 1 END,
    l.provider, l.sandbox_key, l.lease_id, l.created_at,
    CASE WHEN l.state NOT IN ('active', 'provisioning') THEN l.created_at + interval '1 minute'
         END,
    CASE WHEN r.b IN (980, 981, 982) AND r.k < 10 THEN :now - interval '1 hour'
         WHEN r.b = 983 THEN :now - interval '10 seconds' END,
    false, NULL, l.state NOT IN ('active', 'provisioning'),
    CASE WHEN l.state IN ('pending_cleanup', 'destroying') AND r.k >= 6
         THEN :now + interval '5 minutes' END,
    CASE WHEN l.state = 'destroyed' THEN 'destroyed' WHEN l.state = 'abandoned'
         THEN 'destroy-failed' END,
    CASE WHEN l.state IN ('destroyed', 'abandoned') THEN l.updated_at END
FROM leases AS l
JOIN (SELECT 'l' || lpad(i::text, 10, '0') AS lease_id, i % 1000 AS b, i / 1000 AS k
      FROM generate_series(1, :n) AS i) AS r ON r.lease_id = l.lease_id
"""


# Runs whose acquire never recorded a lease (30 at any size, a day old): sweep.reap_runs'
# fails them.
_LEASELESS_RUNS = """
INSERT INTO runs (run_id, thread_id, status, provider, sandbox_key, started_at,
    cancel_requested, reclaim_due)
SELECT 'lost-' || i, NULL, 'running', 'noop', 'key-lost-' || i,
    :now - interval '1 day' - make_interval(secs => i), false, false
FROM generate_series(1, 30) AS i
"""
LEASELESS_GRACE = timedelta(hours=3)

# Runs still running (or interrupted) on a destroyed lease, up to ten at any size: the lease's
# end did not settle them (a lost write). sweep.reap_runs settles them.
_UNSETTLED_RUNS = """
UPDATE runs SET status = CASE WHEN i % 2000 = 500 THEN 'running' ELSE 'interrupted' END,
    exit_code = NULL, finished_at = NULL, reclaim_due = false, reclaim_outcome = NULL,
    reclaimed_at = NULL
FROM (SELECT i FROM generate_series(500, :n, 1000) AS i LIMIT 10) AS g
WHERE runs.run_id = 'r' || lpad(g.i::text, 10, '0')
"""

# Each lease's events, one per state it went through in order: provisioning, active,
# pending_cleanup, destroying, then destroyed or abandoned.
_EVENTS = """
INSERT INTO lease_events (lease_id, at, from_state, to_state, reason, task_id)
SELECT l.lease_id,
    CASE p.n WHEN 1 THEN l.created_at WHEN 2 THEN l.created_at + interval '1 second'
             WHEN 3 THEN l.created_at + interval '30 seconds'
             WHEN 4 THEN (CASE WHEN l.state = 'destroying' THEN l.updated_at
                               ELSE l.created_at + interval '40 seconds' END)
             ELSE l.updated_at END,
    (ARRAY[NULL, 'provisioning', 'active', 'pending_cleanup', 'destroying'])[p.n],
    (ARRAY['provisioning', 'active', 'pending_cleanup', 'destroying', l.state])[p.n],
    'history', NULL
FROM leases AS l
CROSS JOIN LATERAL generate_series(1, CASE l.state WHEN 'provisioning' THEN 1
    WHEN 'active' THEN 2 WHEN 'pending_cleanup' THEN 3 WHEN 'destroying' THEN 4
    ELSE 5 END) AS p(n)
"""


def load_history(engine: Engine, rows: int, analyze_events: bool = True) -> None:
    """Load ``rows`` leases, their runs and events into an empty, migrated PostgreSQL store,
    then VACUUM ANALYZE so the planner knows the real distribution (of the events only if
    ``analyze_events``: an append-only log's statistics lag its growth until autovacuum
    ANALYZEs it, and its reads must not depend on them)."""
    params = {"now": NOW, "n": rows}
    with engine.begin() as conn:
        conn.execute(text(_LEASES), params)
        conn.execute(text(_RUNS), params)
        conn.execute(text(_LEASELESS_RUNS), params)
        conn.execute(text(_UNSETTLED_RUNS), params)
        conn.execute(text(_EVENTS), params)
    with engine.connect() as plain:
        conn = plain.execution_options(isolation_level="AUTOCOMMIT")
        for table in ("leases", "runs", *(("lease_events",) if analyze_events else ())):
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")


@contextlib.contextmanager
def rolled_back(url: str) -> Iterator[Connection]:
    """A connection in a transaction that is rolled back: claims made in it leave no trace."""
    store = Store(url)
    try:
        with store.engine.connect() as connection:
            outer = connection.begin()
            yield connection
            outer.rollback()
    finally:
        store.dispose()


class RolledBackStore(Store):
    """A store whose every transaction is a savepoint inside ``conn``'s open transaction,
    so a benchmark or a plan check can claim rows and roll it all back afterwards."""

    def __init__(self, url: str, conn: Connection) -> None:
        super().__init__(url)
        self.conn = conn

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        with Session(bind=self.conn, join_transaction_mode="create_savepoint",
                     expire_on_commit=False) as session, session.begin():
            yield session

    @contextlib.contextmanager
    def raw_tx(self) -> Iterator[Any]:
        with self.conn.begin_nested():
            yield SessionCursor(self.conn)


def _orphans(sweeps: SweepStore) -> object:
    listed = [f"lk-l{i:010d}" for i in range(1, 101)]  # names a provider listed
    index = sweeps.leases_for("noop", [*listed, "lk-unknown"], ["l0000000001"])
    orphan = Orphan("noop", "lk-unknown", "none", None, {}, "default", "orphan (bench)")
    return index, sweeps.record_orphan(orphan, NOW, 300, None)


# Each sweep's read followed by its claim of what it read, as one tick does it.
SWEEP_READS_AND_CLAIMS: dict[str, Callable[[SweepStore], object]] = {
    "reap_runs.detached": lambda s: s.claim_detached_runs(
        s.due_detached_runs(NOW - DETACH_TTL, 25), NOW - DETACH_TTL, 300),
    "reap_runs.lost_reclaims": lambda s: s.claim_reclaims(s.due_reclaims(NOW, 25), NOW, 300),
    "reap_runs.leaseless": lambda s: s.fail_leaseless_runs(
        s.due_leaseless_runs(NOW - LEASELESS_GRACE, 25), NOW - LEASELESS_GRACE),
    "reap_runs.on_ended_leases": lambda s: s.settle_runs_on_ended_leases(
        s.due_runs_on_ended_leases(25)),
    "expire_leases": lambda s: s.claim_expiries(
        [due.lease_id for due in s.due_expiries(NOW, 25)], NOW, 300, None),
    "retry_cleanup.stale_destroys": lambda s: s.recover_stale_destroys(
        s.due_stale_destroys(NOW, 20, 300), NOW, 300, 5, None),
    "retry_cleanup.cleanups": lambda s: s.claim_cleanups(s.due_cleanups(NOW, 20), NOW, 300),
    "retry_cleanup.abandoned_total": lambda s: s.count_in_state(LeaseState.ABANDONED),
    "stuck_provisioning": lambda s: s.claim_stuck(
        [lease.lease_id for lease in s.due_stuck(NOW, 25)], NOW, 300),
    "orphans": _orphans,
    # the runs bound to the leases whose sandbox a provider listed as exited: 200 leases,
    # 10 of them active with a running run
    "finish_exited": lambda s: s.store.unfinished_runs_on_leases(
        [f"l{i:010d}" for i in range(901, 1101)]),
}


# What the exporter reads at each scrape (workers/metrics/collector.py: the gauges, then the
# logs tailed from where they stand).
def scrape_reads(rows: int) -> dict[str, Callable[[Store], object]]:
    seen = [f"l{i:010d}" for i in range(rows - 49, rows + 1)]  # a batch's destroyed leases
    return {
        "lease_counts": lambda st: Observe(st).lease_counts(),
        "oldest_cleanup_wait": lambda st: Observe(st).oldest_cleanup_wait_since(),
        "run_counts": lambda st: Observe(st).run_counts(),
        "last_ticks": lambda st: Observe(st).last_ticks(),
        "pool_members": lambda st: PoolStore(st).member_counts(["py"]),
        "marks": lambda st: (Observe(st).max_event_id(), Observe(st).max_tick_id(),
                             Observe(st).max_provider_error_id()),
        "events_tail": lambda st: Observe(st).events_from(
            Observe(st).max_event_id() - 50, 1000),  # a scrape's new events
        "destroys_claimed_at": lambda st: Observe(st).last_entered(
            seen, LeaseState.DESTROYING, Observe(st).max_event_id()),
        "reclaims_tail": lambda st: Observe(st).reclaims_since(NOW - timedelta(minutes=5)),
    }


def listings(rows: int) -> dict[str, Callable[[Store], object]]:
    """The real `leases list` / `runs list` pages (models/reports.py), counted as the CLI
    counts them: the first page, a page at mid history, pages filtered by a rare state."""
    middle = rows // 2
    return {
        "leases_list.first_page": lambda st: lease_page(st, LeaseFilter(), 50),
        "leases_list.page_mid_history": lambda st: lease_page(
            st, LeaseFilter(), 50, before=f"l{middle:010d}"),
        "leases_list.abandoned_first_page": lambda st: lease_page(
            st, LeaseFilter(states=(LeaseState.ABANDONED,)), 50),
        "leases_list.active_first_page": lambda st: lease_page(
            st, LeaseFilter(states=(LeaseState.ACTIVE,)), 50),
        "leases_list.tenant_first_page": lambda st: lease_page(
            st, LeaseFilter(tenant="default"), 50),
        "runs_list.first_page": lambda st: run_page(st, (), None, 50),
        "runs_list.page_mid_history": lambda st: run_page(
            st, (), None, 50, before=f"r{middle:010d}"),
        "runs_list.running_first_page": lambda st: run_page(
            st, (RunStatus.RUNNING,), None, 50),
    }
