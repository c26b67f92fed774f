"""A worker or beat started against a store that is not at this leasekeeper's migration
refuses at once, saying which store, where it is and what to run, instead of starting and
failing every task (``relation "runs" does not exist``) or sweep for as long as it runs."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from models.migrate import upgrade
from tests.services import PostgresServer, RedisServer
from tests.stack import REPO, WorkerStack
from workers.preflight import migration_heads, migration_script

pytestmark = pytest.mark.timeout(240)


def previous_revision() -> str:
    (head,) = migration_heads()
    down = migration_script().get_revision(head).down_revision
    assert isinstance(down, str)
    return down


def started(stack: WorkerStack, which: str) -> subprocess.Popen[bytes]:
    if which == "worker":
        return stack.spawn_worker(concurrency=1)
    with open(stack.logfile, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.app", "beat", "-l", "info"],
            cwd=REPO, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    stack.procs.append(proc)
    return proc


def refuses(stack: WorkerStack, which: str) -> str:
    proc = started(stack, which)
    try:
        code = proc.wait(60)
    finally:
        stack.stop()
    log = stack.logfile.read_text()
    assert code != 0, log[-3000:]
    return log


@pytest.mark.parametrize("which", ["worker", "beat"])
def test_a_never_migrated_sqlite_store_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer, which: str) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    stack = WorkerStack(name=f"nm-{uuid.uuid4().hex[:6]}", store_url=url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": f"nm-{uuid.uuid4().hex[:6]}"})
    log = refuses(stack, which)
    assert "never migrated" in log and "leasekeeper db upgrade" in log, log[-3000:]
    assert not (tmp_path / "store.db").exists()  # nothing created


@pytest.mark.postgres
@pytest.mark.parametrize("which", ["worker", "beat"])
def test_a_store_one_migration_behind_is_refused_at_start(
        tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer,
        which: str) -> None:
    url = postgres_server.create_database(f"lk_behind_{uuid.uuid4().hex[:8]}")
    behind = previous_revision()
    upgrade(url, behind)
    stack = WorkerStack(name=f"bh-{uuid.uuid4().hex[:6]}", store_url=url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": f"bh-{uuid.uuid4().hex[:6]}"})
    log = refuses(stack, which)
    assert f"is at migration {behind}" in log and "leasekeeper db upgrade" in log, log[-3000:]
