"""A worker whose PostgreSQL store is stopped and started again under in-flight acquires:
every acquire retries (the hot path's reconnect to a server that refuses connections is
StoreUnavailable, transient) and gets its sandbox once the server is back; nothing is
lost or left behind. The PostgreSQL cluster is this test's own (the session's stays up)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.invariants import check
from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from providers.base import LeaseHandle
from tests.e2e.conftest import eventually
from tests.services import (
    PostgresServer,
    RedisServer,
    _as_postgres,
    _pg_bin,
    accepting_connections,
    start_postgres,
    wait_for_port,
)
from tests.stack import WorkerStack
from workers.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]
ACQUIRES = 4


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of this test's, outside pytest's private tmp dir (the postgres
    user must reach its data dir); stopped at the end, whichever process runs it then."""
    root = Path(tempfile.mkdtemp(prefix="leasekeeper-restart-"))
    root.chmod(0o755)
    server = start_postgres(root / "postgres")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def start_again(server: PostgresServer) -> None:
    """The stopped cluster's postmaster again, on its data dir and port."""
    workdir = server.datadir.parent
    with open(workdir / "postgres.log", "ab") as log:
        server.proc = subprocess.Popen(
            [_pg_bin("postgres"), "-D", str(server.datadir), "-p", str(server.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={workdir}",
             "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT,
            **_as_postgres(),  # type: ignore[call-overload]
        )
    wait_for_port(server.port, 60, server.proc)
    accepting_connections(server, 60)


def test_acquires_in_flight_while_postgresql_restarts_all_get_their_sandbox(
        tmp_path: Path, redis_server: RedisServer, own_postgres: PostgresServer) -> None:
    # Before: the retry's reconnect raised psycopg's OperationalError ("connection
    # refused") raw, not StoreUnavailable: the acquire failed for good, nothing recorded.
    store_url = own_postgres.create_database("lk_restart")
    upgrade(store_url)
    queue = f"restart-{uuid.uuid4().hex[:8]}"  # the session's other workers share Redis
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue,
                                   # retries that span well over the outage
                                   "LEASEKEEPER_TASK_MAX_RETRIES": "30",
                                   "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "0.5",
                                   "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "2"})
    client = create_app(stack.settings())
    try:
        stack.await_worker(stack.spawn_worker(concurrency=2), client)
        # the pool processes' hot-path connections exist (acquires made them)
        warm = [client.send_task("lease.acquire", kwargs={"run_id": f"warm-{i}-{queue}",
                                                          "spec": {}}) for i in range(2)]
        for result in warm:
            result.get(60)
        own_postgres.stop()
        runs = [f"run-{i}-{queue}" for i in range(ACQUIRES)]
        sent = [client.send_task("lease.acquire", kwargs={"run_id": r, "spec": {}})
                for r in runs]

        def retried_twice_or_failed() -> bool:
            log = stack.logfile.read_text(errors="replace")
            return all(f"[{s.id}] transient failure, retry 2 " in log or s.state == "FAILURE"
                       for s in sent)

        # each one's reconnect to the stopped server has failed (at least once)
        eventually(retried_twice_or_failed, 90, "every acquire to retry on the stopped store")
        start_again(own_postgres)
        answers = [s.get(120) for s in sent]
        assert [a["state"] for a in answers] == ["active"] * ACQUIRES
        store = stack.runtime().store
        for run_id, answer in zip(runs, answers, strict=True):
            leases = [lease for lease in store.leases() if lease.run_id == run_id]
            assert [(lease.lease_id, lease.state) for lease in leases] == [
                (answer["lease_id"], LeaseState.ACTIVE)]
        assert check(store, utcnow(), 60.0) == []
        for lease in store.leases():  # nothing left running
            client.send_task("lease.destroy", kwargs={"lease_id": lease.lease_id}).get(60)
        assert not stack.runtime().provider("local").list_managed()
    finally:
        stack.stop()
        client.close()
        local = stack.runtime().provider("local")
        for resource in local.list_managed():  # never leave a process behind
            local.destroy(LeaseHandle(resource.name, resource.backend, {}))


def test_a_sweep_failing_on_a_stopped_store_says_so_in_its_error_and_in_status(
        tmp_path: Path, redis_server: RedisServer, own_postgres: PostgresServer) -> None:
    # Before: a tick on an unavailable store failed with "...; the task will retry" (a sweep
    # is never retried: its next tick is), and `leasekeeper status` said only "sweep.X has
    # not run within 3 intervals: are the workers busy?", though the worker was idle and each
    # tick failed on the store.
    import json
    import sys
    import time

    import redis as redis_client

    from workers.heartbeats import mark_beat

    store_url = own_postgres.create_database("lk_sweepfail")
    upgrade(store_url)
    queue = f"sweepfail-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue,
                                   "LEASEKEEPER_REAP_RUNS_INTERVAL_S": "1"})
    client = create_app(stack.settings())
    marks = redis_client.Redis.from_url(redis_server.url)
    try:
        stack.await_worker(stack.spawn_worker(concurrency=1), client)
        own_postgres.stop()
        # when a tick runs on the stopped store; then it fails saying the next tick retries
        with pytest.raises(Exception, match="unavailable") as failed:
            client.send_task("sweep.reap_runs").get(60)
        text = str(failed.value)
        assert "the task will retry" not in text, text
        assert text.endswith("; the sweep's next tick tries again"), text
        # and status, beat having started long ago, names the failure, not busy workers
        mark_beat(marks, queue, 30, started=time.time() - 3600)
        done = subprocess.run([sys.executable, "-m", "workers.cli", "status", "--json"],
                              env=stack.env, capture_output=True, text=True, timeout=120,
                              check=False)
        report = json.loads(done.stdout)
        problems = report["verdict"]["problems"]
        reap = [p for p in problems if p.startswith("sweep.reap_runs")]
        assert len(reap) == 1, problems
        assert "its last tick failed" in reap[0] and "unavailable" in reap[0], reap
        assert "are the workers busy" not in reap[0], reap
        row = next(r for r in report["sweeps"] if r["sweep"] == "sweep.reap_runs")
        assert row["last_failure"] is not None and "unavailable" in row["last_failure"]["error"]
    finally:
        marks.close()
        stack.stop()
