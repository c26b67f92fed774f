"""A worker started on a store it can read but not write (a read-only SQLite file; a
PostgreSQL role with SELECT only) refuses at once, saying what is read-only, which setting
names it and what to do, instead of starting and failing every lifecycle task on its first
write."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from models.migrate import upgrade
from models.store import Store
from tests.e2e.test_store_schema_at_start import refuses
from tests.services import PostgresServer, RedisServer
from tests.stack import WorkerStack
from tests.store.test_store_refuses_writes import admin

pytestmark = pytest.mark.timeout(240)


def stack_on(url: str, root: Path, redis_server: RedisServer) -> WorkerStack:
    queue = f"ro-{uuid.uuid4().hex[:6]}"
    return WorkerStack(name=queue, store_url=url, root=root, broker_url=redis_server.url,
                       extra_env={"LEASEKEEPER_TASK_QUEUE": queue})


def test_a_worker_on_a_read_only_sqlite_file_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "store.db"
    upgrade(f"sqlite:///{path}")
    used = Store(f"sqlite:///{path}")  # as the workers leave it: in WAL mode
    used.leases()
    used.dispose()
    # Opened as SQLite opens a file it may not write (root ignores a chmod: see
    # tests/store/test_store_refuses_writes.py); the same SQLITE_READONLY either way.
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    log = refuses(stack_on(url, tmp_path, redis_server), "worker")
    for needle in ("leasekeeper worker not started", "is not writable", "read-only",
                   str(path), "LEASEKEEPER_STORE_URL"):
        assert needle in log, log[-3000:]


@pytest.mark.postgres
def test_a_worker_whose_role_may_only_select_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer) -> None:
    name = f"lk_sel_{uuid.uuid4().hex[:8]}"
    user = f"u_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    admin(postgres_server, name, f"CREATE ROLE {user} LOGIN",
          f"GRANT CONNECT ON DATABASE {name} TO {user}",
          f"GRANT USAGE ON SCHEMA public TO {user}",
          f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {user}")
    reader = url.replace("postgres@", f"{user}@")
    log = refuses(stack_on(reader, tmp_path, redis_server), "worker")
    for needle in ("leasekeeper worker not started", "is not writable",
                   f"the user {user} lacks a right", f"grant {user}", "LEASEKEEPER_STORE_URL"):
        assert needle in log, log[-3000:]
