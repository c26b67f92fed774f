"""A worker whose PostgreSQL store stops answering retries, and loses nothing.

The server process behind a pool process's connections freezes (a hung backend, a host
gone without a reset: the kernel still acknowledges, nothing answers). An acquire sent
then must not hold the pool process until the hard time limit: its statement fails once
LEASEKEEPER_STORE_STATEMENT_TIMEOUT_S and a grace have passed, the task retries on a new
connection and gets its sandbox. When the frozen server process wakes up and runs the
statement it was sent, the guarded statements change nothing: one run, one lease, each
change recorded once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest

from models.invariants import check
from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from tests.e2e.conftest import eventually
from tests.services import PostgresServer, RedisServer
from tests.stack import WorkerStack
from tests.store.test_store_stops_answering import watchdog
from workers.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(240)]


@contextlib.contextmanager
def frozen(pids: list[int], release_after_s: float = 90.0) -> Iterator[None]:
    """These server processes stopped; let go on leaving, or by a watchdog if the test
    hangs before that (a wait that ignores every deadline would hang it for good)."""
    def release() -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with watchdog(release, release_after_s):
            yield
    finally:
        release()


def backends_of(pool_pid: int, plain_url: str) -> list[int]:
    """The server processes serving this pool process's connections."""
    ports = {c.laddr.port for c in psutil.Process(pool_pid).net_connections(kind="tcp")
             if c.raddr and c.status == psutil.CONN_ESTABLISHED}
    with psycopg.connect(plain_url, autocommit=True) as admin:
        rows = admin.execute("SELECT pid, client_port FROM pg_stat_activity "
                             "WHERE datname = current_database()").fetchall()
    return [pid for pid, port in rows if port in ports]


def test_an_acquire_on_a_frozen_store_retries_on_a_new_connection_and_loses_nothing(
        tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer) -> None:
    store_url = postgres_server.create_database(f"lk_frozen_{uuid.uuid4().hex[:8]}")
    upgrade(store_url)
    plain = store_url.replace("+psycopg", "")
    # an installation queue of its own: the session's other workers share this Redis
    queue = f"frozen-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_STORE_STATEMENT_TIMEOUT_S": "1",
                                   "LEASEKEEPER_TASK_QUEUE": queue})
    client = create_app(stack.settings())
    try:
        worker = stack.spawn_worker(concurrency=1)
        stack.await_worker(worker, client)
        store = stack.runtime().store
        # the pool process's store connections exist (a first acquire made them)
        first = f"run-{uuid.uuid4().hex[:10]}"
        client.send_task("lease.acquire", kwargs={"run_id": first, "spec": {}}).get(60)
        (pool_pid,) = [child.pid for child in psutil.Process(worker.pid).children()]
        backends = backends_of(pool_pid, plain)
        assert backends, "the pool process has no connection to the store"

        run_id = f"run-{uuid.uuid4().hex[:10]}"
        with frozen(backends):
            result = client.send_task("lease.acquire", kwargs={"run_id": run_id, "spec": {}})
            # the statement sent to the frozen server process fails, and the task retries
            eventually(lambda: "did not answer within 6 s" in stack.logfile.read_text(),
                       60, "the acquire's statement to fail on the frozen store")
            # on a new connection: the run gets its sandbox while that process is frozen
            acquired = result.get(60)
            assert acquired["state"] == "active"
        # once it wakes, it runs what it was sent and finds its client gone: nothing changes
        eventually(lambda: not any(psutil.pid_exists(pid) for pid in backends), 60,
                   "the woken server processes to end")
        leases = [lease for lease in store.leases() if lease.run_id == run_id]
        assert [lease.state for lease in leases] == [LeaseState.ACTIVE]
        events = [(e.from_state, e.to_state) for e in store.events(leases[0].lease_id)]
        assert events == [(None, LeaseState.PROVISIONING),
                          (LeaseState.PROVISIONING, LeaseState.ACTIVE)], events
        assert check(store, utcnow(), 60.0) == []
        assert worker.poll() is None
    finally:
        stack.stop()
        client.close()
