"""The store behind PgBouncer (Debian's, real) in transaction mode, where each statement of
a client may run on another server connection than the one before it.

The lifecycle's hot path prepares its statements (models/pq_cursor.py): behind such a
pooler a prepared statement is often missing on the next server connection (26000), or
already there under the same name (42P05). Either way every lifecycle must still end
well, with LEASEKEEPER_STORE_PREPARED_STATEMENTS left on (the process stops preparing at
the first 26000) and set to false (nothing is prepared). And a migration must release its
lock with its transaction: a session lock stays on the pooled server connection, and the
next upgrade that lands on another one waits for it forever.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from models.invariants import check
from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from tests.services import PgBouncer, PostgresServer, RedisServer, start_pgbouncer
from tests.stack import REPO, WorkerStack
from workers.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

LIFECYCLES = 24
WARNING = "SQLSTATE 26000"


@pytest.fixture
def bouncer(postgres_server: PostgresServer) -> Iterator[PgBouncer]:
    pooler = start_pgbouncer(postgres_server, "transaction", pool_size=2)
    yield pooler
    pooler.stop()


def fresh_database(postgres: PostgresServer, bouncer: PgBouncer) -> tuple[str, str]:
    """A new database: its URL through the pooler, and straight to the server."""
    name = f"lk_bouncer_{uuid.uuid4().hex[:8]}"
    direct = postgres.create_database(name)
    return bouncer.url(name), direct


def advisory_locks(direct_url: str) -> int:
    with psycopg.connect(direct_url.replace("+psycopg", ""), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                           ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize(("pool_mode", "prepared"), [
    ("transaction", "true"), ("transaction", "false"), ("session", "true")])
def test_every_lifecycle_ends_well_behind_pgbouncer(
        pool_mode: str, prepared: str, tmp_path: Path, redis_server: RedisServer,
        postgres_server: PostgresServer) -> None:
    # given a worker of 4 pool processes whose store is behind the pooler (in transaction
    # mode 2 server connections: one client's statements land on either; in session mode
    # one for each client)
    bouncer = start_pgbouncer(postgres_server, pool_mode,
                              pool_size=2 if pool_mode == "transaction" else 60)
    try:
        lifecycles_behind(bouncer, prepared, tmp_path, redis_server, postgres_server)
    finally:
        bouncer.stop()


def lifecycles_behind(bouncer: PgBouncer, prepared: str, tmp_path: Path,
                      redis_server: RedisServer, postgres_server: PostgresServer) -> None:
    url, direct = fresh_database(postgres_server, bouncer)
    upgrade(url)
    queue = f"bouncer-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=url, root=tmp_path, broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue,
                                   "LEASEKEEPER_STORE_PREPARED_STATEMENTS": prepared})
    client = create_app(stack.settings())
    try:
        stack.await_worker(stack.spawn_worker(concurrency=4), client)
        # when runs acquire sandboxes and destroy them, 4 at a time
        acquires = [client.send_task("lease.acquire", kwargs={
            "run_id": f"run-{uuid.uuid4().hex[:10]}", "spec": {"provider": "noop"}})
            for _ in range(LIFECYCLES)]
        leases = [result.get(120) for result in acquires]
        destroys = [client.send_task("lease.destroy", kwargs={"lease_id": lease["lease_id"]})
                    for lease in leases]
        for result in destroys:
            result.get(120)
        # then every one got its sandbox and gave it back, each change recorded once
        assert [lease["state"] for lease in leases] == ["active"] * LIFECYCLES
        store = stack.runtime().store
        try:
            for lease in leases:
                events = [(e.from_state, e.to_state) for e in store.events(lease["lease_id"])]
                assert events[:2] == [(None, LeaseState.PROVISIONING),
                                      (LeaseState.PROVISIONING, LeaseState.ACTIVE)], events
                assert store.get_lease(lease["lease_id"]).state == LeaseState.DESTROYED
            assert check(store, utcnow(), 60.0) == []
        finally:
            store.dispose()
        # and a pool process that stopped preparing said so once (not at all when told)
        said = stack.logfile.read_text()
        if prepared == "false":
            assert WARNING not in said
        else:
            assert said.count(WARNING) <= 4, said  # once per pool process at most
    finally:
        stack.stop()
        client.close()
    assert advisory_locks(direct) == 0


def test_an_upgrade_behind_pgbouncer_leaves_no_lock_for_the_next_to_wait_on(
        postgres_server: PostgresServer, bouncer: PgBouncer) -> None:
    # given a store migrated through the pooler
    url, direct = fresh_database(postgres_server, bouncer)
    upgrade(url)
    # then its migration lock went with its transaction, not left on a server connection
    assert advisory_locks(direct) == 0
    # and two more upgrades started together through the pooler both finish
    upgrades = [subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "db", "upgrade"], cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LEASEKEEPER_STORE_URL": url},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        outputs = [proc.communicate(timeout=120)[0].decode() for proc in upgrades]
    finally:
        for proc in upgrades:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [proc.returncode for proc in upgrades] == [0, 0], outputs
    assert advisory_locks(direct) == 0


def test_a_statement_missing_on_the_server_connection_runs_unprepared_from_then_on(
        postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from models import pq_cursor

    monkeypatch.setattr(pq_cursor._Preparing, "on", True)
    # given a hot-path cursor that prepared its statement on this server connection
    with psycopg.connect(postgres_server.url().replace("+psycopg", ""),
                         autocommit=True) as conn:
        cursor = pq_cursor.PqCursor(conn, answer_within_s=30)
        statement = "SELECT %(a)s::int + 1"
        assert cursor.execute(statement, {"a": 1}).fetchall() == [(2,)]
        # when the next statement lands where it is not prepared (a pooler's other server
        # connection: here the same one, its statements dropped)
        conn.execute("DEALLOCATE ALL")
        # then it is sent again unprepared, and runs once
        assert cursor.execute(statement, {"a": 2}).fetchall() == [(3,)]
        # and this process prepares nothing more, having said so once
        assert pq_cursor._Preparing.on is False
        assert cursor.execute("SELECT %(b)s::int * 2", {"b": 4}).fetchall() == [(8,)]
        prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        assert prepared == (0,)
        assert sum(WARNING in r.getMessage() for r in caplog.records) == 1
