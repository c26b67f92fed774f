"""`leasekeeper health --store` and `status` on a store that answers reads but refuses
writes (a read-only SQLite file; a PostgreSQL database with default_transaction_read_only,
as after a failover to a replica): reported not writable, naming the fix, exit 1. Before,
both called it healthy (they only read), while every task failed on its first write."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from models.migrate import upgrade
from models.schema import LeaseState
from models.store import Store
from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import short_error
from tests.e2e.test_cli_leases_input import add, one_line
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


@pytest.mark.postgres
def test_a_cli_write_refused_by_a_read_only_database_names_the_fix_not_a_task_retry(
        postgres_server: PostgresServer, tmp_path: Path, redis_server: RedisServer) -> None:
    # Before: "... read-only ...: point LEASEKEEPER_STORE_URL at the primary; the task will
    # retry with backoff (a failover ends), and fails with this message if it outlasts the
    # retries": a CLI command runs no task and retries nothing.
    name = f"lk_ro_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    store = Store(url)
    try:
        lease_id = add(store, LeaseState.ABANDONED)
    finally:
        store.dispose()
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    admin(postgres_server, "postgres",
          f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    for command in (("leases", "forget", lease_id), ("leases", "retry", lease_id)):
        said = one_line(leasekeeper(*command, env=env), 2, "read-only",
                        "point LEASEKEEPER_STORE_URL at the primary")
        assert "task will retry" not in said and "the retries" not in said, (command, said)


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Makes a file or folder read-only even for root (``chattr +i``: the tests run as
    root, whom permissions do not stop); every one is made mutable again at teardown,
    whatever the test did."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed: cannot make a folder read-only for root")
    probe = tmp_path / "chattr-probe"
    probe.touch()
    tried = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, text=True,
                           check=False)
    subprocess.run(["chattr", "-i", str(probe)], capture_output=True, check=False)
    probe.unlink()
    if tried.returncode != 0:
        pytest.skip(f"chattr +i does not work on {tmp_path}'s filesystem: "
                    f"{tried.stderr.strip()}")
    made: list[Path] = []

    def make(path: Path) -> None:
        made.append(path)
        subprocess.run(["chattr", "+i", str(path)], check=True)

    try:
        yield make
    finally:
        for path in reversed(made):
            subprocess.run(["chattr", "-i", str(path)], check=False)


def a_sqlite_store(folder: Path, *, used: bool) -> str:
    """A migrated SQLite store in ``folder``; ``used``: opened by a Store since, so in WAL
    mode (as the workers leave it; its -wal and -shm files are gone once closed)."""
    folder.mkdir()
    url = f"sqlite:///{folder / 'store.db'}"
    upgrade(url)
    if used:
        store = Store(url)
        store.leases()
        store.dispose()
    return url


@pytest.mark.parametrize("used", [True, False], ids=["wal", "just-migrated"])
@pytest.mark.parametrize("file_too", [False, True], ids=["folder", "folder-and-file"])
def test_a_read_only_sqlite_folder_is_named_with_the_fix(
        tmp_path: Path, immutable: Callable[[Path], None], used: bool,
        file_too: bool) -> None:
    # Before: "cannot reach the store ... OperationalError: unable to open database file"
    # (or "... is unavailable ...; the task will retry"), exit 3. A store just migrated
    # is not in WAL mode yet, and a Store's first connection writes it so: `db current`
    # alone, which only reads, still answers then.
    folder = tmp_path / "var"
    url = a_sqlite_store(folder, used=used)
    if file_too:
        immutable(folder / "store.db")
    immutable(folder)
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_VAR_DIR=str(tmp_path))
    for command in (["leases", "list"], ["check"], *([["db", "current"]] if used else [])):
        done = leasekeeper(*command, env=env)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        short_error(done, f"the store's folder {folder} is read-only",
                    "LEASEKEEPER_STORE_URL", "writable")
        assert "unable to open database file" not in done.stderr


def test_an_upgrade_of_a_read_only_sqlite_file_names_the_file(
        tmp_path: Path, immutable: Callable[[Path], None]) -> None:
    # Before: "cannot create the store's folder ...: Operation not permitted", though the
    # folder was there (and writable).
    folder = tmp_path / "var"
    url = a_sqlite_store(folder, used=True)
    immutable(folder / "store.db")
    done = leasekeeper("db", "upgrade", env=cli_env(LEASEKEEPER_STORE_URL=url))
    assert done.returncode == 2, done.stdout + done.stderr
    short_error(done, f"the SQLite file {folder / 'store.db'} is read-only",
                "LEASEKEEPER_STORE_URL")
    assert "cannot create the store's folder" not in done.stderr
