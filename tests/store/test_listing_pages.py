"""`leases list` and `runs list` pages (models/reports.py) on SQLite and PostgreSQL: keyset
pages, newest first, that visit every row once even while new rows arrive between pages,
a total counted up to COUNT_CAP, filters, and a clear error for a cursor that names no run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import insert

from models import reports
from models.reports import LeaseFilter, lease_page, run_page
from models.schema import Lease, LeaseState, Run, RunStatus, utcnow
from models.store import Store
from providers.errors import NotFound
from tasks.leases import new_lease_id


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    yield s
    s.dispose()


def add(store: Store, count: int, state: str = LeaseState.DESTROYED, tenant: str = "acme",
        minutes_ago: int = 0) -> list[str]:
    """``count`` leases (and a run each), created in that order; their ids."""
    ids = []
    with store.tx() as s:
        for _ in range(count):
            lease_id = new_lease_id()
            ids.append(lease_id)
            at = utcnow() - timedelta(minutes=minutes_ago)
            s.execute(insert(Lease).values(
                lease_id=lease_id, sandbox_key=f"k-{lease_id}", provider="noop",
                provider_lease_id=f"lk-{lease_id}", state=state, tenant=tenant,
                run_id=f"r-{lease_id}", created_at=at, updated_at=at, acquire_deadline_at=at,
                deadline_at=at, idle_timeout_s=60))
            s.execute(insert(Run).values(
                run_id=f"r-{lease_id}", status=RunStatus.COMPLETED, provider="noop",
                lease_id=lease_id, started_at=at))
    return ids


def walk(fetch: object, limit: int, key: str = "lease_id") -> list[str]:
    """Every id a listing shows, page after page (fetch(before) -> Page)."""
    seen: list[str] = []
    before = None
    while True:
        page = fetch(before)  # type: ignore[operator]
        seen += [getattr(r, key) for r in page.rows]
        assert len(page.rows) <= limit
        if page.next_before is None:
            return seen
        before = page.next_before


def test_lease_pages_visit_every_lease_once_newest_first(store: Store) -> None:
    # given 23 leases
    ids = add(store, 23)
    # when the listing is read 5 at a time, and new leases arrive after the first page
    first = lease_page(store, LeaseFilter(), 5)
    time.sleep(0.002)  # ids order by millisecond, then randomly within one
    later = add(store, 3)
    rest = walk(lambda before: lease_page(store, LeaseFilter(), 5,
                                          before or first.next_before), 5)
    # then the pages held every lease of the first page's moment once, newest first
    assert [x.lease_id for x in first.rows] + rest == sorted(ids, reverse=True)
    # and the new ones head the next listing
    assert [x.lease_id for x in lease_page(store, LeaseFilter(), 3).rows] == sorted(
        later, reverse=True)
    assert (first.total, first.total_capped, first.limit) == (23, False, 5)


def test_lease_page_filters_and_counts_what_it_filters(store: Store) -> None:
    add(store, 4, tenant="acme")
    active = add(store, 2, state=LeaseState.ACTIVE, tenant="other")
    old = add(store, 1, tenant="acme", minutes_ago=120)
    page = lease_page(store, LeaseFilter(states=(LeaseState.ACTIVE,)), 50)
    assert [x.lease_id for x in page.rows] == sorted(active, reverse=True)
    assert page.total == 2
    assert page.next_before is None
    by_tenant = lease_page(store, LeaseFilter(tenant="acme"), 50)
    assert by_tenant.total == 5 and {x.tenant for x in by_tenant.rows} == {"acme"}
    older = lease_page(store, LeaseFilter(created_before=utcnow() - timedelta(hours=1)), 50)
    assert [x.lease_id for x in older.rows] == old
    uncounted = lease_page(store, LeaseFilter(), 2, counted=False)
    assert len(uncounted.rows) == 2 and uncounted.total == 0


def test_the_total_is_counted_up_to_the_cap(store: Store, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    # given more leases than the count's cap (made small here)
    monkeypatch.setattr(reports, "COUNT_CAP", 10)
    add(store, 12)
    # then the total says "at least the cap", and the text shows it
    page = lease_page(store, LeaseFilter(), 5)
    assert (page.total, page.total_capped, page.total_text) == (10, True, "10+")
    exact = lease_page(store, LeaseFilter(states=(LeaseState.ACTIVE,)), 5)
    assert (exact.total, exact.total_capped, exact.total_text) == (0, False, "0")


def test_run_pages_newest_first_and_a_cursor_that_names_no_run(store: Store) -> None:
    ids = add(store, 7)
    runs = walk(lambda before: run_page(store, (), None, 3, before), 3, key="run_id")
    assert sorted(runs) == sorted(f"r-{x}" for x in ids) and len(runs) == len(ids)
    assert run_page(store, (RunStatus.RUNNING,), None, 3).rows == []
    with pytest.raises(NotFound, match="no run 'nope' to list runs before"):
        run_page(store, (), None, 3, before="nope")
