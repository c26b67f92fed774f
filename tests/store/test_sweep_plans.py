"""Every sweep's read and claim, every listing page (`leases list`, `runs list`, with
its capped count), and every read the exporter makes at each scrape, is index-bound on
PostgreSQL: the planner, on a history of 20,000 leases and runs and their ~100,000 events
(ANALYZEd, no planner settings changed), reads no table of leases, runs or events
sequentially (but for a capped count's first rows, right under its LIMIT). The statements
are the ones the real SweepStore and listing functions execute, captured as they run."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event

from models.migrate import upgrade
from models.observe import Observe
from models.reports import Page, run_page
from models.schema import RunStatus
from models.store import Store
from models.sweep_store import SweepStore
from tests.services import PostgresServer
from tests.store.history import (
    SWEEP_READS_AND_CLAIMS,
    RolledBackStore,
    listings,
    load_history,
    rolled_back,
    scrape_reads,
)

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]
ROWS = 20_000
SCANNED_TABLES = {"leases", "runs", "lease_events"}


@pytest.fixture(scope="module")
def history_url(postgres_server: PostgresServer) -> str:
    url = postgres_server.create_database(f"lk_plans_{uuid.uuid4().hex[:8]}")
    upgrade(url)
    store = Store(url, statement_timeout_s=3600.0)  # a bulk load
    try:
        # the events not ANALYZEd: as a busy log is between autovacuum's ANALYZEs (a read of
        # it that relies on its statistics scanned all of it, on a QA store)
        load_history(store.engine, ROWS, analyze_events=False)
    finally:
        store.dispose()
    return url


@pytest.fixture
def conn(history_url: str) -> Iterator[Connection]:
    """A connection in a transaction that is rolled back: the claims leave no trace."""
    with rolled_back(history_url) as connection:
        yield connection


def run_capturing(conn: Connection, history_url: str, call: Callable[[Store], object]
                  ) -> tuple[object, list[tuple[str, Any]]]:
    captured: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE", "INSERT", "DELETE",
                                                  "WITH")):
            captured.append((statement, parameters))

    event.listen(conn.engine, "before_cursor_execute", capture)
    try:
        result = call(RolledBackStore(history_url, conn))
    finally:
        event.remove(conn.engine, "before_cursor_execute", capture)
    return result, captured


def sequential_scans(plan: dict[str, Any], under_limit: bool = False) -> list[str]:
    """Sequential scans of leases or runs in a plan; one that filters nothing, right under
    a LIMIT, is bounded (a capped count's first COUNT_CAP rows) and not counted."""
    node = plan["Node Type"]
    bounded = under_limit and "Filter" not in plan
    found = [plan["Relation Name"]] if (node == "Seq Scan" and not bounded
                                        and plan.get("Relation Name") in SCANNED_TABLES) else []
    for child in plan.get("Plans", []):
        found += sequential_scans(child, node == "Limit")
    return found


def assert_index_bound(conn: Connection, statements: list[tuple[str, Any]]) -> None:
    assert statements, "nothing was executed"
    for statement, parameters in statements:
        (plan_doc,) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}",
                                           parameters).scalar_one()
        plan = plan_doc["Plan"]
        assert not sequential_scans(plan), (
            f"sequential scan in:\n{statement}\n{parameters}\n"
            + "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}",
                                                                parameters)))


@pytest.mark.parametrize("sweep", sorted(SWEEP_READS_AND_CLAIMS))
def test_each_sweep_read_and_claim_is_index_bound(conn: Connection, history_url: str,
                                                   sweep: str) -> None:
    # given a realistic history; when the sweep reads what is due and claims it
    call = SWEEP_READS_AND_CLAIMS[sweep]
    result, statements = run_capturing(conn, history_url, lambda st: call(SweepStore(st)))
    # then it found work (the plans below are of a real tick, not of an empty one)
    assert result, f"{sweep} found nothing due in the seeded history"
    # and no statement it ran reads leases or runs sequentially
    assert_index_bound(conn, statements)


@pytest.mark.parametrize("listing", sorted(listings(ROWS)))
def test_each_listing_page_is_index_bound(conn: Connection, history_url: str,
                                          listing: str) -> None:
    # given a realistic history; when a listing's page is read, rows and total
    page, statements = run_capturing(conn, history_url, listings(ROWS)[listing])
    # then it is a real page (rows, a total, a cursor for the next one)
    assert isinstance(page, Page) and 0 < len(page.rows) <= 50 and page.total > 0
    assert page.next_before is not None or page.total <= 50
    # and neither its rows nor its count read leases or runs sequentially
    assert_index_bound(conn, statements)


# `runs list --status X` for a status few runs have, or none (0.7% of this history failed,
# none aborted): a walk of the start-order index that filters by status reads the whole
# history before it gives up on finding a page.
RARE_STATUS_PAGES: dict[str, Callable[[Store], object]] = {
    "failed": lambda st: run_page(st, (RunStatus.FAILED,), None, 50),
    "aborted (none)": lambda st: run_page(st, (RunStatus.ABORTED,), None, 50),
}


def rows_discarded(plan: dict[str, Any]) -> int:
    """Rows a plan (EXPLAIN ANALYZE) read and then threw away, all its nodes summed."""
    own = (plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)
           ) * plan.get("Actual Loops", 1)
    return int(own) + sum(rows_discarded(child) for child in plan.get("Plans", []))


@pytest.mark.parametrize("status", sorted(RARE_STATUS_PAGES))
def test_a_runs_page_of_a_rare_status_reads_only_runs_of_that_status(
        conn: Connection, history_url: str, status: str) -> None:
    # given a realistic history; when a page of runs of one rare status is read, with count
    _, statements = run_capturing(conn, history_url, RARE_STATUS_PAGES[status])
    assert statements, "nothing was executed"
    # then neither the page nor its count reads runs of other statuses to throw them away
    for statement, parameters in statements:
        (plan_doc,) = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}",
                                           parameters).scalar_one()
        discarded = rows_discarded(plan_doc["Plan"])
        assert discarded <= 100, (
            f"{discarded} rows read and discarded by:\n{statement}\n"
            + "\n".join(row[0] for row in conn.exec_driver_sql(
                f"EXPLAIN ANALYZE {statement}", parameters)))


@pytest.mark.parametrize("read", sorted(scrape_reads(ROWS)))
def test_each_scrape_read_is_index_bound(conn: Connection, history_url: str,
                                         read: str) -> None:
    # given a realistic history; when the exporter (or `status`) reads what it shows
    _, statements = run_capturing(conn, history_url, scrape_reads(ROWS)[read])
    # then no statement it ran reads leases, runs or events sequentially
    assert_index_bound(conn, statements)


def live_rows(conn: Connection) -> int:
    """The leases not ended and the runs not finished: what a read of the live state may
    have to look at, whatever the history's size."""
    return int(conn.exec_driver_sql(
        "SELECT (SELECT count(*) FROM leases WHERE state NOT IN ('destroyed', 'abandoned'))"
        " + (SELECT count(*) FROM runs WHERE status IN ('running', 'interrupted'))"
    ).scalar_one())


# Reads that look for the rare rows among the live ones: the ended leases' unsettled runs,
# the leases waiting for cleanup's first pending_cleanup event. An index walk that filters
# the history (every run by start time, every pending_cleanup event) is not a sequential
# scan, yet costs as much.
LIVE_STATE_READS: dict[str, Callable[[Store], object]] = {
    "reap_runs.on_ended_leases": lambda st: SweepStore(st).due_runs_on_ended_leases(25),
    "oldest_cleanup_wait": lambda st: Observe(st).oldest_cleanup_wait_since(),
}


@pytest.mark.parametrize("read", sorted(LIVE_STATE_READS))
def test_a_read_of_the_live_state_reads_no_history(conn: Connection, history_url: str,
                                                    read: str) -> None:
    # given a realistic history (98% of it ended); when a read of the live state is made
    result, statements = run_capturing(conn, history_url, LIVE_STATE_READS[read])
    assert result, f"{read} found nothing in the seeded history"
    assert statements, "nothing was executed"
    # then it reads and throws away no more rows than there are live ones
    budget = live_rows(conn)
    for statement, parameters in statements:
        (plan_doc,) = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}",
                                           parameters).scalar_one()
        discarded = rows_discarded(plan_doc["Plan"])
        assert discarded <= budget, (
            f"{discarded} rows read and discarded (live rows: {budget}) by:\n{statement}\n"
            + "\n".join(row[0] for row in conn.exec_driver_sql(
                f"EXPLAIN ANALYZE {statement}", parameters)))
