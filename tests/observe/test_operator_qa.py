"""What an operator QA pass found in the exporter and the console, each against the real
`leasekeeper metrics` / `leasekeeper console` process:

- with LEASEKEEPER_CONSOLE_PORT=0 (as with the exporter's port 0) the line printed at start
  names the port the server listens on, not 0;
- every lease state is exported by leasekeeper_leases, 0 when no lease is in it: the
  series of the last active lease reads 0 once it is destroyed, not "no data";
- a store the exporter cannot read is logged saying what the exporter does (the next
  scrape reads it again), not that a task will retry (the exporter runs no task).
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg
import pytest

from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from models.store import NewLease, Store
from tests.e2e.conftest import cli_env, eventually
from tests.e2e.test_cli_errors import closed_port
from tests.observe.exporter import REPO, running_exporter
from tests.services import PostgresServer, RedisServer, stop_process

pytestmark = pytest.mark.timeout(240)
NOT_DESTROYED = [s for s in LeaseState if s != LeaseState.DESTROYED]


def add_lease(store: Store, state: LeaseState, tenant: str = "acme") -> str:
    lease_id = f"qa-{uuid.uuid4().hex[:12]}"
    now = utcnow()
    store.create_intent(NewLease(
        lease_id=lease_id, sandbox_key=f"sk-{lease_id}", provider="noop",
        provider_lease_id=f"lk-{lease_id}", reuse=False, tenant=tenant, thread_id=None,
        run_id=f"run-{lease_id}", spec={}, acquire_deadline_at=now + timedelta(minutes=1),
        deadline_at=now + timedelta(hours=1), idle_timeout_s=60), task_id=None)
    if state != LeaseState.PROVISIONING:
        assert store.transition(lease_id, {LeaseState.PROVISIONING}, state,
                                "set up by the test") is not None
    return lease_id


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("command", ["console", "metrics"])
def test_port_0_prints_the_port_it_listens_on(command: str, host: str,
                                              redis_server: RedisServer,
                                              tmp_path: Path) -> None:
    # Before: the console printed "console: http://127.0.0.1:0/" and listened elsewhere;
    # on ::1 the exporter printed "http://::1:PORT/metrics", a URL nothing can open.
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    password = secrets.token_urlsafe(12)
    env = cli_env(LEASEKEEPER_STORE_URL=store_url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_CONSOLE_PORT="0",
                  LEASEKEEPER_METRICS_PORT="0", LEASEKEEPER_CONSOLE_HOST=host,
                  LEASEKEEPER_METRICS_HOST=host,
                  LEASEKEEPER_FLOWER_BASIC_AUTH=f"ops:{password}")
    in_url = f"[{host}]" if ":" in host else host
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", command], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        found = re.match(rf"{command}: http://{re.escape(in_url)}:(\d+)/", line)
        assert found, line
        port = int(found.group(1))
        assert port != 0, line
        path = "/leases" if command == "console" else "/metrics"
        resp = httpx.get(f"http://{in_url}:{port}{path}", auth=("ops", password),
                         timeout=30)
        assert resp.status_code == 200, resp.text[:300]
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def test_every_lease_state_is_exported_0_when_none(tmp_path: Path) -> None:
    # Before: leasekeeper_leases{state="active"} vanished with the last active lease.
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    store = Store(store_url)
    try:
        with running_exporter(tmp_path / "exporter.log", LEASEKEEPER_STORE_URL=store_url,
                              LEASEKEEPER_PROVIDERS="noop", LEASEKEEPER_PROVIDER="noop",
                              LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:{closed_port()}/0",
                              LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="0.2") as exporter:
            empty = exporter.scrape()
            for state in NOT_DESTROYED:
                assert empty.value("leasekeeper_leases", state=state, provider="noop",
                                   tenant="other") == 0, state
            assert empty.labels("leasekeeper_leases", "state") == set(NOT_DESTROYED)

            lease_id = add_lease(store, LeaseState.ACTIVE)
            busy = exporter.scrape()
            assert busy.value("leasekeeper_leases", state="active", provider="noop",
                              tenant="acme") == 1
            assert busy.value("leasekeeper_leases", state="warm", provider="noop",
                              tenant="acme") == 0

            assert store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.DESTROYED,
                                    "destroyed by the test") is not None
            after = exporter.scrape()
            assert after.labels("leasekeeper_leases", "state") == set(NOT_DESTROYED)
            assert after.total("leasekeeper_leases", state="active") == 0
            assert after.value("leasekeeper_leases", state="active", provider="noop",
                               tenant="other") == 0
    finally:
        store.dispose()


@pytest.mark.postgres
def test_a_store_the_exporter_cannot_read_names_the_next_scrape_not_a_task(
        postgres_server: PostgresServer, tmp_path: Path) -> None:
    name = f"lk_{uuid.uuid4().hex[:12]}"
    store_url = postgres_server.create_database(name)
    upgrade(store_url)
    admin = f"postgresql://postgres@127.0.0.1:{postgres_server.port}/postgres"
    log = tmp_path / "exporter.log"
    with running_exporter(log, LEASEKEEPER_STORE_URL=store_url,
                          LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:{closed_port()}/0",
                          LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="0.2") as exporter:
        assert exporter.scrape().value("leasekeeper_store_up") == 1
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s", (name,))
        try:
            eventually(lambda: exporter.scrape().value("leasekeeper_store_up") == 0)
            text = log.read_text()
            assert "is unavailable" in text, text[-2000:]
            assert "task will retry" not in text, text[-2000:]
            assert "the next scrape reads it again" in text, text[-2000:]
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        eventually(lambda: exporter.scrape().value("leasekeeper_store_up") == 1)


@pytest.mark.postgres
def test_the_first_request_after_a_database_restart_is_answered(
        postgres_server: PostgresServer, redis_server: RedisServer, tmp_path: Path) -> None:
    # Before: the first console page after PostgreSQL restarted answered 503 "... is
    # unavailable (AdminShutdown: terminating connection due to administrator command)",
    # and the exporter's first scrape said leasekeeper_store_up 0: both took a pooled
    # connection the restart had closed. A reader retries nothing, so it checks first.
    name = f"lk_{uuid.uuid4().hex[:12]}"
    store_url = postgres_server.create_database(name)
    upgrade(store_url)
    admin = f"postgresql://postgres@127.0.0.1:{postgres_server.port}/postgres"
    password = secrets.token_urlsafe(12)
    env = cli_env(LEASEKEEPER_STORE_URL=store_url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_CONSOLE_PORT="0",
                  LEASEKEEPER_FLOWER_BASIC_AUTH=f"ops:{password}")
    console = subprocess.Popen([sys.executable, "-m", "workers.cli", "console"], cwd=REPO,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert console.stdout is not None
        line = console.stdout.readline().decode()
        found = re.match(r"console: (http://127\.0\.0\.1:\d+)/", line)
        assert found, line

        def page() -> httpx.Response:
            return httpx.get(f"{found.group(1)}/leases", auth=("ops", password), timeout=30)

        with running_exporter(tmp_path / "exporter.log", LEASEKEEPER_STORE_URL=store_url,
                              LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:{closed_port()}/0",
                              LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="0.2") as exporter:
            assert page().status_code == 200
            assert exporter.scrape().value("leasekeeper_store_up") == 1
            # what a restart does to every connection the two hold in their pools
            with psycopg.connect(admin, autocommit=True) as conn:
                ended = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()", (name,)).fetchone()
            assert ended is not None and ended[0] >= 2, ended
            answer = page()
            assert answer.status_code == 200, answer.text[:500]
            assert exporter.scrape().value("leasekeeper_store_up") == 1
    finally:
        stop_process(console)  # type: ignore[arg-type]
