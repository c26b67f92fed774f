"""A store written at any earlier migration goes to head keeping every record's meaning,
and this leasekeeper then works on it: from each revision, on SQLite and PostgreSQL, a
realistic history (runs and leases in every state, their events, sweep ticks, provider
errors, pools and pool members where the revision has them) is written as that
revision's code wrote it, the store is upgraded, and then

- every row and value written is there, unchanged; a column added later is NULL;
- the lifecycle's invariants hold (models/invariants.py);
- a lease active before the upgrade is destroyed (its events name the states it left),
  and a run that finished before the upgrade is reclaimed.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from models.invariants import check
from models.migrate import upgrade
from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from models.store import Store
from workers.runtime import Runtime
from workers.settings import Settings


def revisions() -> list[str]:
    """Every migration but the latest, oldest first."""
    from alembic.script import ScriptDirectory

    from models.migrate import MIGRATIONS

    script = ScriptDirectory(str(MIGRATIONS))
    chain = [s.revision for s in script.walk_revisions()]  # newest first
    return list(reversed(chain))[:-1]


NOW = utcnow().replace(microsecond=0)
AGO = NOW - timedelta(hours=2)
LATER = NOW + timedelta(hours=2)

# a lease in each state -> its run's status, its end reason
LEASES: dict[str, tuple[str, str | None]] = {
    "provisioning": (RunStatus.RUNNING, None),
    "active": (RunStatus.RUNNING, None),
    "destroying": (RunStatus.ABORTED, "requested"),
    "pending_cleanup": (RunStatus.FAILED, "expired"),
    "destroyed": (RunStatus.COMPLETED, "requested"),
    "abandoned": (RunStatus.FAILED, "requested"),
}
LIVE = {"provisioning", "active", "warm"}


def lease_row(state: str, run_id: str | None, pool: str | None = None) -> dict[str, Any]:
    lease_id = f"l-{state}-{run_id or pool}"
    key = f"key-{lease_id}"
    return {
        "lease_id": lease_id, "sandbox_key": key, "live_key": key if state in LIVE else None,
        "provider": "noop", "provider_lease_id": f"lk-{lease_id}",
        "backend": "none" if state != "provisioning" else None,
        "provider_meta": json.dumps({"note": "written before the upgrade"}), "state": state,
        "reuse": False, "tenant": "acme", "thread_id": "thread-1" if run_id else None,
        "run_id": run_id, "spec": json.dumps({"tenant": "acme", "labels": {"team": "a"}}),
        "created_at": AGO, "updated_at": AGO,
        "ready_at": AGO if state not in ("provisioning",) else None,
        "acquire_deadline_at": LATER, "deadline_at": LATER, "idle_timeout_s": 900,
        "idle_deadline_at": LATER if state in ("active", "warm") else None,
        "cleanup_attempts": 5 if state == "abandoned" else 0,
        "next_cleanup_at": LATER if state == "pending_cleanup" else None,
        "end_reason": LEASES.get(state, (None, None))[1],
        "last_error": "injected" if state == "abandoned" else None, "version": 3,
        "pool": pool, "claimed_at": None, "prev_state": None,
    }


def run_row(run_id: str, status: str, lease_id: str | None, *,
            reclaimed: bool = False) -> dict[str, Any]:
    done = status not in (RunStatus.RUNNING, RunStatus.INTERRUPTED)
    return {
        "run_id": run_id, "thread_id": "thread-1", "status": status,
        "exit_code": 0 if status == RunStatus.COMPLETED else None, "provider": "noop",
        "sandbox_key": f"key-{lease_id}" if lease_id else None, "lease_id": lease_id,
        "started_at": AGO, "finished_at": AGO + timedelta(minutes=5) if done else None,
        "detached_since": None, "cancel_requested": False,
        "error": "it broke" if status == RunStatus.FAILED else None,
        "reclaim_due": done, "reclaim_claimed_until": None,
        "reclaim_outcome": ReclaimOutcome.DESTROYED if reclaimed else None,
        "reclaimed_at": AGO + timedelta(minutes=6) if reclaimed else None,
    }


def history(has_pools: bool) -> dict[str, list[dict[str, Any]]]:
    leases, runs, events = [], [], []
    for state, (status, _) in LEASES.items():
        run_id = f"run-{state}"
        lease = lease_row(state, run_id)
        leases.append(lease)
        # a finished run on a destroyed lease was reclaimed; the others wait for it
        runs.append(run_row(run_id, status, lease["lease_id"],
                            reclaimed=state == "destroyed"))
        path = {"provisioning": [None, "provisioning"],
                "active": [None, "provisioning", "active"],
                "destroying": [None, "provisioning", "active", "destroying"],
                "pending_cleanup": [None, "provisioning", "active", "pending_cleanup"],
                "destroyed": [None, "provisioning", "active", "destroying", "destroyed"],
                "abandoned": [None, "provisioning", "active", "destroying",
                              "pending_cleanup", "abandoned"]}[state]
        events += [{"lease_id": lease["lease_id"], "at": AGO, "from_state": a, "to_state": b,
                    "reason": f"{a} -> {b}", "task_id": "t-1"}
                   for a, b in itertools.pairwise(path)]
    # a run that never got a lease (its acquire is recent: started as this test writes it,
    # not when the module was imported, which a long session leaves past the grace), and
    # one that finished without
    runs.append({**run_row("run-leaseless", RunStatus.RUNNING, None),
                 "started_at": utcnow().replace(microsecond=0)})
    runs.append(run_row("run-completed-no-lease", RunStatus.COMPLETED, None))
    if has_pools:
        member = lease_row("warm", None, pool="py")
        leases.append(member)
        events.append({"lease_id": member["lease_id"], "at": AGO, "from_state": None,
                       "to_state": "provisioning", "reason": "pool fill", "task_id": None})
        events.append({"lease_id": member["lease_id"], "at": AGO,
                       "from_state": "provisioning", "to_state": "warm",
                       "reason": "pool member ready", "task_id": None})
    return {"leases": leases, "runs": runs, "lease_events": events}


def extras(tables: set[str]) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    if "sweep_ticks" in tables:
        rows["sweep_ticks"] = [{"sweep": "sweep.reap_runs", "at": AGO, "run": "ran",
                                "took_ms": 12, "counts": json.dumps({"failed": 1}),
                                "items": json.dumps({"items": []}), "task_id": "t-9"}]
    if "provider_errors" in tables:
        rows["provider_errors"] = [{"at": AGO, "provider": "noop", "operation": "destroy",
                                    "task": "lease.destroy", "error_class": "transient",
                                    "status": 503, "error_type": "ProviderUnavailable"}]
    if "pools" in tables:
        rows["pools"] = [{"name": "py", "consecutive_failures": 1, "failures_total": 4,
                          "open_until": None, "last_error": "quota", "updated_at": AGO}]
    return rows


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        yield server.create_database(f"lk_up_{uuid.uuid4().hex[:10]}")


def write(url: str) -> dict[str, list[dict[str, Any]]]:
    """The history, with only the columns the store has now (as that revision wrote it)."""
    engine = create_engine(url)
    try:
        found = inspect(engine)
        tables = set(found.get_table_names())
        rows = {**history("pools" in tables), **extras(tables)}
        written: dict[str, list[dict[str, Any]]] = {}
        with engine.begin() as conn:
            for table, table_rows in rows.items():
                have = {c["name"] for c in found.get_columns(table)}
                written[table] = [{k: v for k, v in row.items() if k in have}
                                  for row in table_rows]
                for row in written[table]:
                    conn.execute(text(f"INSERT INTO {table} ({', '.join(row)}) VALUES "
                                      f"({', '.join(':' + k for k in row)})"), row)
        return written
    finally:
        engine.dispose()


KEYS = {"leases": "lease_id", "runs": "run_id", "lease_events": "reason",
        "sweep_ticks": "sweep", "provider_errors": "error_type", "pools": "name"}


def read(url: str, table: str) -> dict[str, dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            result = conn.execute(text(f"SELECT * FROM {table}")).mappings().all()
        return {f"{row[KEYS[table]]}/{row.get('lease_id', '')}": dict(row) for row in result}
    finally:
        engine.dispose()


def same(written: Any, found: Any) -> bool:
    if isinstance(found, dict | list) and isinstance(written, str):
        return bool(json.loads(written) == found)
    if isinstance(found, str) and isinstance(written, str) and found.startswith(("{", "[")):
        return bool(json.loads(written) == json.loads(found))
    if isinstance(written, datetime) and isinstance(found, str):
        return datetime.fromisoformat(found) == written
    return bool(written == found)


def runtime(url: str) -> Runtime:
    settings = Settings(providers=["local", "noop", "faulty"], store_url=url,
                        cleanup_backoff_s=0, claim_timeout_s=3)
    return Runtime(settings=settings, store=Store(url))


@pytest.mark.parametrize("revision", revisions())
def test_a_store_written_at_an_earlier_revision_upgrades_and_works(
        empty_url: str, revision: str) -> None:
    from tasks.destroy import destroy_lease
    from tasks.reclaim import reclaim_run

    # given a store at an earlier revision, with a history written then
    upgrade(empty_url, revision)
    written = write(empty_url)
    # when it is upgraded to head
    upgrade(empty_url)
    # then every row is there with the values it was written with; new columns are NULL
    for table, rows in written.items():
        found = read(empty_url, table)
        assert len(found) == len(rows), table
        for row in rows:
            key = f"{row[KEYS[table]]}/{row.get('lease_id', '')}"
            have = found[key]
            for column, value in row.items():
                assert same(value, have[column]), (table, key, column, value, have[column])
            if table == "leases":
                assert have["prev_state"] is None
                if "pool" not in row:
                    assert (have["pool"], have["claimed_at"]) == (None, None)
    rt = runtime(empty_url)
    try:
        store = rt.store
        # and the invariants hold: the records tell the same truth as before
        assert check(store, NOW, 60.0, {"py": 2} if "pools" in written else None,
                     leaseless_grace_s=600.0) == []
        # and a worker destroys a lease that was active before the upgrade
        active = "l-active-run-active"
        done = destroy_lease(rt, active, "requested", "t-after")
        assert done.error is None, done.error
        lease = store.get_lease(active)
        assert (lease.state, lease.live_key, lease.end_reason) == (
            LeaseState.DESTROYED, None, "requested")
        assert [(e.from_state, e.to_state) for e in store.events(active)][-2:] == [
            (LeaseState.ACTIVE, LeaseState.DESTROYING),
            (LeaseState.DESTROYING, LeaseState.DESTROYED)]
        run = store.get_run("run-active")
        assert run is not None and run.status == RunStatus.ABORTED
        # and reclaims a run that finished before the upgrade (its lease destroyed too)
        reclaimed = reclaim_run(rt, "run-pending_cleanup", "t-reclaim")
        assert reclaimed.as_dict()["outcome"] == ReclaimOutcome.DESTROYED, reclaimed
        assert store.get_lease("l-pending_cleanup-run-pending_cleanup").state == (
            LeaseState.DESTROYED)
        # a new run on the old key of the destroyed lease gets a new lease
        assert store.live_lease_for_key(f"key-{active}") is None
        assert check(store, utcnow(), 60.0, leaseless_grace_s=600.0) == []
    finally:
        rt.store.dispose()
