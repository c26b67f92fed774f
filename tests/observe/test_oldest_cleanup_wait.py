"""`leasekeeper_cleanup_oldest_wait_seconds` reads, of the leases still waiting for
cleanup (pending_cleanup, destroying), the earliest pending_cleanup event of the one that
has waited longest: not a later re-entry, not a lease that has since ended, not another
state's event. On SQLite and PostgreSQL, through the real Observe read the exporter makes."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import insert

from models.observe import Observe
from models.schema import Lease, LeaseEvent
from models.store import Store
from tests.store.test_upgrade_with_data import lease_row

T0 = datetime(2026, 5, 1, 12, 0, 0)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_the_oldest_wait_is_the_earliest_pending_cleanup_event_of_a_waiting_lease(
        store_url: str) -> None:
    store = Store(store_url)
    try:
        # given two leases waiting (one pending_cleanup, one destroying) and one destroyed
        rows = [lease_row("pending_cleanup", "r1"), lease_row("destroying", "r2"),
                lease_row("destroyed", "r3")]
        waiting, destroying, ended = (r["lease_id"] for r in rows)
        events = [
            # the destroyed lease waited longest of all: it no longer counts
            (ended, 0, "active", "pending_cleanup"), (ended, 1, "pending_cleanup", "destroying"),
            (ended, 2, "destroying", "destroyed"),
            # the destroying lease first needed cleanup at 10, went back to it at 30
            (destroying, 5, "provisioning", "active"),
            (destroying, 10, "active", "pending_cleanup"),
            (destroying, 20, "pending_cleanup", "destroying"),
            (destroying, 25, "destroying", "pending_cleanup"),
            (destroying, 30, "pending_cleanup", "destroying"),
            # the pending_cleanup lease: at 15
            (waiting, 3, "provisioning", "active"), (waiting, 15, "active", "pending_cleanup"),
        ]
        with store.tx() as s:
            s.execute(insert(Lease.__table__), [
                {**r, "provider_meta": {}, "spec": {}} for r in rows])
            s.execute(insert(LeaseEvent.__table__), [
                {"lease_id": lease, "at": at(m), "from_state": frm, "to_state": to,
                 "reason": "test"} for lease, m, frm, to in events])
        # when the exporter reads the oldest wait
        since = Observe(store).oldest_cleanup_wait_since()
        # then it is the destroying lease's first pending_cleanup event
        assert since == at(10)
        # and with that lease gone from the waiting states, the other one's
        with store.tx() as s:
            s.execute(Lease.__table__.update().where(Lease.lease_id == destroying)
                      .values(state="destroyed"))
        assert Observe(store).oldest_cleanup_wait_since() == at(15)
        # and with none waiting, none
        with store.tx() as s:
            s.execute(Lease.__table__.update().where(Lease.lease_id == waiting)
                      .values(state="destroyed"))
        assert Observe(store).oldest_cleanup_wait_since() is None
    finally:
        store.dispose()
