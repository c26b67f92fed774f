"""`leasekeeper health --store` and `status` on a store that answers reads but refuses
writes (a read-only SQLite file; a PostgreSQL database with default_transaction_read_only,
as after a failover to a replica): reported not writable, naming the fix, exit 1. Before,
both called it healthy (they only read), while every task failed on its first write."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from models.migrate import upgrade
from models.store import Store
from tests.e2e.conftest import cli_env, leasekeeper
from tests.services import PostgresServer, RedisServer
from tests.store.test_store_refuses_writes import admin

pytestmark = pytest.mark.timeout(120)


def assert_not_writable(env: dict[str, str], *needles: str) -> None:
    health = leasekeeper("health", "--store", env=env)
    assert health.returncode == 1, health.stdout + health.stderr
    assert "Traceback" not in health.stderr
    assert health.stderr.startswith("unhealthy store: "), health.stderr
    for needle in ("is not writable", "LEASEKEEPER_STORE_URL", *needles):
        assert needle in health.stderr, health.stderr
    status = leasekeeper("status", "--json", env=env)
    assert status.returncode == 1, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert report.get("store_writable") is False, report["verdict"]
    assert report["store"]["leases"] is not None  # it still reads: the rest is shown
    assert any("is not writable" in p for p in report["verdict"]["problems"]), report
    text = leasekeeper("status", env=env)
    assert text.returncode == 1 and "is not writable" in text.stdout + text.stderr


def test_a_read_only_sqlite_file(tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "store.db"
    upgrade(f"sqlite:///{path}")
    used = Store(f"sqlite:///{path}")  # as the workers leave it: in WAL mode
    used.leases()
    used.dispose()
    writable = cli_env(LEASEKEEPER_STORE_URL=f"sqlite:///{path}",
                       LEASEKEEPER_BROKER_URL=redis_server.url,
                       LEASEKEEPER_VAR_DIR=str(tmp_path))
    healthy = leasekeeper("health", "--store", env=writable)
    assert (healthy.returncode, healthy.stderr) == (0, "")
    # Opened as SQLite opens a file it may not write (root ignores file permissions).
    read_only = {**writable, "LEASEKEEPER_STORE_URL": f"sqlite:///file:{path}?mode=ro&uri=true"}
    assert_not_writable(read_only, "read-only", str(path))


@pytest.mark.postgres
def test_a_read_only_postgresql_database(postgres_server: PostgresServer, tmp_path: Path,
                                         redis_server: RedisServer) -> None:
    name = f"lk_ro_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    admin(postgres_server, "postgres",
          f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    assert_not_writable(env, "read-only", "point LEASEKEEPER_STORE_URL at the primary")
