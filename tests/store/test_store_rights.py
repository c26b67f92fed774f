"""`leasekeeper db upgrade` on a PostgreSQL store it may not change: a read-only server
(a replica, or default_transaction_read_only=on) or a user without rights to a table. One
line naming what is wrong and what to do, exit code 2 (a setting to fix, not a store to
wait for), and nothing half-written: the store stays at the migration it was at."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from models.migrate import upgrade
from tests.services import PostgresServer
from tests.stack import REPO
from workers.preflight import current_revisions

pytestmark = pytest.mark.postgres


def db_upgrade(url: str) -> tuple[int, str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")},
           "LEASEKEEPER_STORE_URL": url, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "workers.cli", "db", "upgrade"], cwd=REPO,
                          env=env, capture_output=True, timeout=120, check=False)
    return done.returncode, (done.stdout + done.stderr).decode()


def admin(server: PostgresServer, database: str, *statements: str) -> None:
    with psycopg.connect(server.url(database).replace("+psycopg", ""),
                         autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def test_a_read_only_store_is_named_with_the_fix(postgres_server: PostgresServer) -> None:
    name = f"lk_ro_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url, "0011_perf12")
    admin(postgres_server, "postgres",
          f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    code, out = db_upgrade(url)
    assert code == 2, out
    assert "read-only" in out and "primary" in out and "LEASEKEEPER_STORE_URL" in out, out
    assert current_revisions(url) == {"0011_perf12"}


def test_a_user_without_rights_is_named_with_the_fix(postgres_server: PostgresServer) -> None:
    name = f"lk_rights_{uuid.uuid4().hex[:8]}"
    user = f"u_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url, "0011_perf12")
    admin(postgres_server, name, f"CREATE ROLE {user} LOGIN",
          f"GRANT CONNECT ON DATABASE {name} TO {user}",
          f"GRANT USAGE ON SCHEMA public TO {user}",
          f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {user}")
    code, out = db_upgrade(url.replace("postgres@", f"{user}@"))
    assert code == 2, out
    assert "must be owner" in out and "lacks a right" in out and user in out, out
    assert current_revisions(url) == {"0011_perf12"}
