"""`leasekeeper metrics` and `leasekeeper console` started on a store that is not at this
leasekeeper's migration refuse at once (exit 2), with the words a worker uses (which store,
what to run), instead of serving and failing every scrape or page on a SQL error
(``no such table: leases``) for as long as they run. Nothing is created."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from models.migrate import upgrade
from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_store_schema_at_start import previous_revision
from tests.services import PostgresServer, RedisServer

pytestmark = pytest.mark.timeout(240)

SERVERS = ["metrics", "console"]


def refused(command: str, url: str, tmp_path: Path, redis_server: RedisServer) -> str:
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_METRICS_PORT="0",
                  LEASEKEEPER_CONSOLE_PORT="0",
                  LEASEKEEPER_FLOWER_BASIC_AUTH="ops:not-the-point")
    # Before: it served for ever (the timeout fails the test); now it exits at once.
    done = leasekeeper(command, env=env, timeout_s=90)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"leasekeeper {command} not started: " in done.stderr, done.stderr
    assert "leasekeeper db upgrade" in done.stderr, done.stderr
    return done.stderr


@pytest.mark.parametrize("command", SERVERS)
def test_a_never_migrated_sqlite_store_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer, command: str) -> None:
    store = tmp_path / "store.db"
    said = refused(command, f"sqlite:///{store}", tmp_path, redis_server)
    assert "never migrated" in said and str(store) in said, said
    assert not store.exists()  # nothing created


@pytest.mark.postgres
@pytest.mark.parametrize("command", SERVERS)
def test_a_store_one_migration_behind_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer,
        command: str) -> None:
    url = postgres_server.create_database(f"lk_obs_{uuid.uuid4().hex[:8]}")
    behind = previous_revision()
    upgrade(url, behind)
    said = refused(command, url, tmp_path, redis_server)
    assert f"is at migration {behind}" in said, said
