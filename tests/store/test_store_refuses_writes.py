"""A store that stops accepting writes AFTER the worker started (preflight already refuses
one at start): the task's error says plainly what is wrong, what to do, and whether it is
retried, on every path the lifecycle takes (the plain-SQL hot path and the sessions).

- read-only (PostgreSQL SQLSTATE 25006: a failover to a replica, or
  default_transaction_read_only=on; SQLite: a read-only file): StoreReadOnly, transient
  (retried with backoff: a failover ends), naming LEASEKEEPER_STORE_URL and the primary;
- a right taken from the store's user (42501, e.g. REVOKE UPDATE ON leases):
  StoreNotPermitted, terminal (a missing right does not come back by itself), naming the
  user, the table and the fix.

On SQLite the tests run as root, which file permissions do not stop, so the read-only
file is opened as SQLite opens a file it may not write: the URI's ``mode=ro`` (the same
SQLITE_READONLY "attempt to write a readonly database" a chmod-ed file gives).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import update

from models.migrate import upgrade
from models.schema import LeaseState, Run, RunStatus
from models.store import Store
from providers.errors import (
    StoreError,
    StoreNotPermitted,
    StoreReadOnly,
    StoreUnavailable,
    is_transient,
)
from tests.services import PostgresServer
from tests.store.test_plain_sql import new_lease

PASSWORD = "s3cret-pw"  # trust auth ignores it; it must never reach a message


def admin(server: PostgresServer, database: str, *statements: str) -> None:
    with psycopg.connect(server.url(database).replace("+psycopg", ""),
                         autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def seeded(store: Store) -> None:
    """A run with its provisioning lease (l1, run-1), as a started acquire leaves them."""
    assert store.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)


def set_detached_in_a_session(store: Store) -> None:
    with store.tx() as s:
        s.execute(update(Run).where(Run.run_id == "run-1")
                  .values(detached_since=None, cancel_requested=True))


# What the lifecycle does, each a write: a new run's intent, the acquire's activation, a
# destroy's claim, a run's end (a session), any session write (Store.tx).
LIFECYCLE: dict[str, Callable[[Store], object]] = {
    "start_run_with_intent": lambda s: s.start_run_with_intent(
        "run-2", new_lease("l2", "k2", "run-2"), None),
    "move": lambda s: s.move("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready"),
    "claim_to_destroy": lambda s: s.claim_to_destroy(
        "l1", {LeaseState.PROVISIONING}, "destroy", None, "released"),
    "finish_run": lambda s: s.finish_run("run-1", RunStatus.COMPLETED, 0, None, False, None),
    "tx": set_detached_in_a_session,
}


def failure(store: Store, call: Callable[[Store], object]) -> StoreError:
    with pytest.raises(StoreError) as caught:
        call(store)
    return caught.value


def assert_read_only(err: StoreError, where: str) -> None:
    text = str(err)
    assert isinstance(err, StoreReadOnly), f"{type(err).__name__}: {text}"
    assert isinstance(err, StoreUnavailable) and is_transient(err), text
    assert "read-only" in text and "LEASEKEEPER_STORE_URL" in text, text
    assert where in text, text
    assert "will retry" in text, text
    assert PASSWORD not in text, text
    assert "lease store error" not in text, text


# -- PostgreSQL ------------------------------------------------------------------------
@pytest.fixture
def pg_database(postgres_server: PostgresServer) -> Iterator[str]:
    name = f"lk_w_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    yield name


@pytest.mark.postgres
@pytest.mark.parametrize("call", list(LIFECYCLE))
def test_a_store_turned_read_only_after_start_is_named_and_retried(
        postgres_server: PostgresServer, pg_database: str, call: str) -> None:
    url = postgres_server.url(pg_database).replace("postgres@", f"postgres:{PASSWORD}@")
    store = Store(url)
    try:
        seeded(store)  # the worker started on a writable store
        # then the database turns read-only (as after a failover to a replica): new
        # connections get it
        admin(postgres_server, "postgres",
              f"ALTER DATABASE {pg_database} SET default_transaction_read_only = on")
        store.dispose()
        err = failure(store, LIFECYCLE[call])
        assert_read_only(err, "primary")
        assert "cannot execute" in str(err), err  # what the server said
        # and once the primary is writable again, the retry works: the read-only
        # connection was not kept
        admin(postgres_server, "postgres",
              f"ALTER DATABASE {pg_database} SET default_transaction_read_only = off")
        LIFECYCLE[call](store)
    finally:
        store.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("call", list(LIFECYCLE))
def test_a_right_revoked_after_start_names_the_user_and_the_fix_and_is_not_retried(
        postgres_server: PostgresServer, pg_database: str, call: str) -> None:
    user = f"u_{uuid.uuid4().hex[:8]}"
    admin(postgres_server, pg_database, f"CREATE ROLE {user} LOGIN",
          f"GRANT CONNECT ON DATABASE {pg_database} TO {user}",
          f"GRANT USAGE ON SCHEMA public TO {user}",
          f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {user}",
          f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {user}")
    url = postgres_server.url(pg_database).replace("postgres@", f"{user}:{PASSWORD}@")
    store = Store(url)
    try:
        seeded(store)  # the worker started with every right it needs
        # then rights are taken away, on connections already open
        admin(postgres_server, pg_database, f"REVOKE UPDATE ON leases FROM {user}",
              f"REVOKE INSERT, UPDATE ON runs FROM {user}")
        err = failure(store, LIFECYCLE[call])
        text = str(err)
        assert isinstance(err, StoreNotPermitted), f"{type(err).__name__}: {text}"
        assert not is_transient(err), text
        assert not isinstance(err, StoreUnavailable), text
        assert "permission denied for table" in text, text  # what the server said
        assert f"user {user} lacks a right" in text, text
        assert "on table leases" in text or "on table runs" in text, text
        assert f"grant {user}" in text and "owner" in text, text
        assert "not retried" in text, text
        assert PASSWORD not in text, text
        assert "lease store error" not in text, text
    finally:
        store.dispose()


# -- SQLite ----------------------------------------------------------------------------
@pytest.mark.parametrize("call", list(LIFECYCLE))
def test_a_read_only_sqlite_file_is_named_and_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    writable = Store(url)
    seeded(writable)
    writable.dispose()
    # A URI-style URL (database "file:<path>"): the store's files are the file's own,
    # nothing is made relative to the working folder (where the writers' lock file was
    # made as "file:<path>.writers" before).
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    store = Store(f"sqlite:///file:{path}?mode=ro&uri=true")
    try:
        err = failure(store, LIFECYCLE[call])
        assert_read_only(err, str(path))
        assert "attempt to write a readonly database" in str(err), err
        assert "writable" in str(err), err
        assert list(elsewhere.iterdir()) == []
    finally:
        store.dispose()


@pytest.mark.parametrize(("url", "file"), [
    ("sqlite:////srv/lk/store.db", "/srv/lk/store.db"),
    ("sqlite:///relative.db", "relative.db"),
    ("sqlite:///file:/srv/lk/store.db?mode=ro&uri=true", "/srv/lk/store.db"),
    ("sqlite:///file:///srv/lk/store.db?uri=true", "/srv/lk/store.db"),
    ("sqlite:///file://localhost/srv/lk/store.db?uri=true", "/srv/lk/store.db"),
    ("sqlite:///file:mem?mode=memory&uri=true", None),
    ("sqlite:///:memory:", None),
    ("postgresql+psycopg://u@127.0.0.1/lk", None),
])
def test_the_store_file_of_a_url(url: str, file: str | None) -> None:
    from models.migrate import sqlite_file

    found = sqlite_file(url)
    assert (None if found is None else str(found)) == file
