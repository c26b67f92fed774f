"""Checks a command runs before it uses the broker or the store, so a person gets one line
naming the setting, the address and the fix, never a traceback or a silent hang.

    check_broker(url)   Redis answers a PING within a second or two (not something
                        else, an HTTP server, say) and is not full   -> BrokerUnavailable
                        and takes the URL's password                 -> ConfigError
    check_store(url)    the driver is installed, the SQLite folder and file exist (and
                        can be opened: not a read-only folder), the
                        schema is at the latest migration            -> ConfigError
                                                                         StoreUnavailable
    check_store_writable(url)  it takes writes (not a replica, not a read-only file,
                        not a user without UPDATE)                   -> ConfigError
    store_fit_to_start(process, url, writes)  both, at a worker's, beat's, the exporter's or
                        the console's start: one message for all     -> ConfigError
Nothing here creates anything: a store that was never migrated stays absent (no empty
SQLite file), and the message names `leasekeeper db upgrade`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from models.shown_url import shown_url
from providers.errors import (
    READ_ONLY_SQLITE,
    READ_ONLY_STORE,
    BrokerUnavailable,
    ConfigError,
    StoreUnavailable,
    lacks_right,
)

UPGRADE = "run `leasekeeper db upgrade` (with the same LEASEKEEPER_STORE_URL)"


class NewerStore(ConfigError):
    """The store is at a migration this leasekeeper does not have: a newer one ran."""


def check_broker(url: str, timeout_s: float = 2.0) -> None:
    from tasks.broker_words import broker_full, broker_unreachable, database_missing

    client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        client.ping()
        if refuses_writes(client):
            raise BrokerUnavailable(broker_full(url, sending=False))
    except redis.AuthenticationError as exc:  # a setting to fix, not a service to wait for
        raise ConfigError(broker_unreachable(url, exc, sending=False)) from None
    except redis.RedisError as exc:  # refused, silent, or not Redis
        if database_missing(exc):  # a setting too: no such database there
            raise ConfigError(broker_unreachable(url, exc, sending=False)) from None
        raise BrokerUnavailable(broker_unreachable(url, exc, sending=False)) from None
    finally:
        client.close()


def refuses_writes(client: redis.Redis[Any]) -> bool:
    """Redis is full: past its maxmemory, it refuses the writes every task needs (with
    noeviction; another policy evicts keys first). INFO memory, as Redis itself counts
    it: used memory less what eviction does not count (replication and AOF buffers). A
    Redis that refuses INFO (renamed on some managed ones) is not called full."""
    try:
        memory = client.info("memory")
    except redis.ResponseError:
        return False
    limit = int(memory.get("maxmemory", 0))
    counted = int(memory.get("used_memory", 0)) - int(memory.get("mem_not_counted_for_evict", 0))
    return limit > 0 and counted > limit


def refuse_a_broker_that_refuses_us(process: str) -> None:
    """At a worker's or beat's start: a broker that refuses the URL's password will never
    let it in, so exit at once (code 2) naming LEASEKEEPER_BROKER_URL, instead of retrying
    for ever under "Cannot connect". A broker not answering yet is no reason to refuse
    (Celery retries until it does)."""
    from workers.settings import get_settings

    try:
        check_broker(get_settings().effective_broker_url)
    except ConfigError as exc:
        logging.getLogger("leasekeeper.preflight").critical(
            "leasekeeper %s not started: %s", process, exc)
        sys.exit(2)
    except BrokerUnavailable:
        pass  # Celery says so, and retries


def shown(url: str | URL) -> str:
    """A store URL as it may be printed: no password, in its user part or its query
    (models/shown_url.py)."""
    return shown_url(url)


def check_driver(url: str) -> None:
    """The database driver the URL names is importable, or say which package to install."""
    try:
        make_url(url).get_dialect().import_dbapi()
    except (ArgumentError, ValueError) as exc:
        raise ConfigError(f"LEASEKEEPER_STORE_URL is not a database URL ({exc})") from None
    except ModuleNotFoundError as exc:
        package = {"psycopg": "'leasekeeper[postgres]' (psycopg)",
                   "psycopg2": "psycopg2-binary, or use postgresql+psycopg:// with "
                               "'leasekeeper[postgres]'"}.get(exc.name or "", str(exc.name))
        raise ConfigError(
            f"the store {shown(url)} (LEASEKEEPER_STORE_URL) needs the Python package "
            f"{exc.name!r}, which is not installed: pip install {package}"
        ) from None


def migrate(url: str, revision: str = "head") -> None:
    """`leasekeeper db upgrade` (and `up`): the driver checked first, failures in one line."""
    from alembic.util.exc import CommandError

    from models.migrate import sqlite_file, upgrade

    check_driver(url)
    refuse_a_directory(url, sqlite_file(url))  # (a folder that is not there, it creates)
    try:
        upgrade(url, revision)
    except SQLAlchemyError as exc:
        raise store_error(url, exc, "cannot migrate") from None
    except OSError as exc:  # the SQLite store's folder cannot be made, or its file opened
        read_only = read_only_sqlite(url)
        if read_only is not None:  # the folder is there: not "cannot create" it
            raise ConfigError(f"cannot migrate the store {shown(url)}: {read_only}") from None
        raise ConfigError(
            f"cannot create the store's folder for {shown(url)}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}; point LEASEKEEPER_STORE_URL "
            "(or LEASEKEEPER_VAR_DIR) at a directory this user can write") from None
    except CommandError as exc:
        newer = unknown_revisions(url)
        if newer:
            raise NewerStore(newer_store_message(url, newer)) from None
        raise ConfigError(
            f"cannot migrate the store {shown(url)} to {revision!r}: {exc}; leave "
            "--revision out to upgrade to the latest migration") from None


def unknown_revisions(url: str, current: set[str] | None = None) -> list[str]:
    """The store's migrations that this leasekeeper does not have (a newer one ran)."""
    return sorted((current_revisions(url) if current is None else current) - _known())


def newer_store_message(url: str, revisions: list[str]) -> str:
    latest = ", ".join(sorted(migration_heads()))
    return (f"the store {shown(url)} is at migration {', '.join(revisions)}, which this "
            f"leasekeeper does not have (its latest is {latest}): a "
            "newer leasekeeper migrated it. Run that newer version against this store, or go "
            f"back to this one with `leasekeeper db downgrade {latest} "
            "--yes` run with that newer version, which has those migrations")


def sqlite_store_file(url: str) -> Path | None:
    """A SQLite store's database file, once its folder is known to be there (ConfigError
    naming the folder otherwise); None for another database. Creates nothing, and opens
    nothing: connecting would leave an empty file where no store was."""
    from models.migrate import sqlite_file

    path = sqlite_file(url)
    if path is not None:
        refuse_a_directory(url, path)
        if path.parent.exists() and not path.parent.is_dir():
            raise ConfigError(
                f"the store's folder {path.parent} is not a folder (LEASEKEEPER_STORE_URL="
                f"{shown(url)}): point LEASEKEEPER_STORE_URL (or LEASEKEEPER_VAR_DIR) at a "
                "directory")
        if not path.parent.is_dir():
            raise ConfigError(
                f"the store's folder {path.parent} does not exist (LEASEKEEPER_STORE_URL="
                f"{shown(url)}): point LEASEKEEPER_STORE_URL (or LEASEKEEPER_VAR_DIR) at the "
                f"right place, or create the folder and {UPGRADE}"
            )
    return path


def refuse_a_directory(url: str, path: Path | None) -> None:
    """A SQLite store's path (``path``, of ``url``) that is a directory: ConfigError saying
    it must name a file. Without it, a directory reads as a store never migrated, and
    `db upgrade` as a folder it cannot create."""
    if path is not None and path.is_dir():
        raise ConfigError(
            f"the store's path {path} is a directory (LEASEKEEPER_STORE_URL={shown(url)}): "
            f"it must name a file, e.g. {path / 'store.db'}")


def read_only_sqlite(url: str) -> str | None:
    """What is read-only of a SQLite store whose folder exists, and what to do, if its
    folder or file is (for this user: permissions, ``chattr +i``, a read-only mount); None
    otherwise. Said where SQLite only says "unable to open database file" (it cannot
    create the -wal and -shm files in a read-only folder) and where a migration cannot
    open the file to lock it."""
    from models.migrate import sqlite_file

    path = sqlite_file(url)
    if path is None or not path.parent.is_dir():
        return None
    if not os.access(path.parent, os.W_OK):
        return (f"the store's folder {path.parent} is read-only (its permissions, an "
                "immutable attribute or a read-only mount): make the folder writable by "
                "this user (SQLite creates the store's -wal and -shm files in it), or point "
                "LEASEKEEPER_STORE_URL at a writable store")
    if path.exists() and not os.access(path, os.W_OK):
        return READ_ONLY_SQLITE.format(path=path)  # the store's own wording of it
    return None


def _in_wal_mode(path: Path) -> bool:
    """The SQLite file is in WAL mode (its header's read and write versions are 2)."""
    with open(path, "rb") as file:
        header = file.read(20)
    return header[18:20] == b"\x02\x02"


def check_store(url: str) -> None:
    check_driver(url)
    path = sqlite_store_file(url)
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"there is no store at {path} (never migrated): {UPGRADE}")
        read_only = read_only_sqlite(url)
        if read_only is not None and not _in_wal_mode(path):
            # The store's first connection puts the file in WAL mode (models/store.py): a
            # write, which fails ("unable to open database file" in a read-only folder).
            # In WAL mode already, it may still be read: schema_position finds out.
            raise ConfigError(f"cannot open the store {shown(url)}: {read_only}")
    from workers.db_revisions import SchemaPosition, schema_position

    where = schema_position(url)
    match where.position:
        case SchemaPosition.NEWER:
            raise NewerStore(newer_store_message(url, unknown_revisions(url, set(where.current))))
        case SchemaPosition.NEVER_MIGRATED:
            raise ConfigError(f"the store {shown(url)} has no schema (it was never migrated): "
                              f"{UPGRADE}")
        case SchemaPosition.BEHIND:
            raise ConfigError(f"the store {shown(url)} is at migration "
                              f"{', '.join(where.current)}, this leasekeeper needs "
                              f"{', '.join(where.heads)}: {UPGRADE}")


# A SQLite store's disk with less free than this takes no more commits: a lifecycle pair
# writes about 160 KiB of WAL, and a checkpoint copies pages back into the file.
SQLITE_MIN_FREE_BYTES = 1024 * 1024


def check_store_writable(url: str) -> None:
    """The store takes writes: an UPDATE that matches no row, rolled back. A replica, a
    database with default_transaction_read_only=on, a read-only SQLite file or a user
    without UPDATE refuse it (ConfigError, naming the fix); reads alone cannot tell. A
    SQLite store's disk that is full fails it too (StoreUnavailable: freeing space fixes
    it): that UPDATE needs no free page, and every real write fails."""
    from sqlalchemy import text

    engine = create_engine(url, poolclass=NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as conn:
            try:
                conn.execute(text("UPDATE leases SET state = state WHERE 1 = 0"))
            finally:
                conn.rollback()
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        said = " ".join(str(orig).split()).removeprefix("ERROR: ")[:200]
        sqlstate = getattr(orig, "sqlstate", None)
        if sqlstate in _NOT_ALLOWED:
            who = make_url(url).username or "the URL's user"
            raise ConfigError(f"the store {shown(url)} is not writable ({said}): "
                              f"{_NOT_ALLOWED[sqlstate](who)} (LEASEKEEPER_STORE_URL)"
                              ) from None
        if str(getattr(orig, "sqlite_errorname", "")).startswith("SQLITE_READONLY"):
            from models.migrate import sqlite_file

            raise ConfigError(f"the store {shown(url)} is not writable ({said}): "
                              + READ_ONLY_SQLITE.format(path=sqlite_file(url))) from None
        raise store_error(url, exc, "cannot write to") from None
    finally:
        engine.dispose()
    _check_sqlite_disk(url)


def _check_sqlite_disk(url: str) -> None:
    path = sqlite_store_file(url)
    if path is None or not path.is_file():
        return
    disk = os.statvfs(path.parent)
    # root may write into the blocks reserved for it; anyone else only into what is left
    free = (disk.f_bfree if os.geteuid() == 0 else disk.f_bavail) * disk.f_frsize
    if free < SQLITE_MIN_FREE_BYTES:
        raise StoreUnavailable(
            f"the disk holding the store {path} is full ({free} bytes free): every write "
            "fails with 'database or disk is full'; free space there (or move "
            "LEASEKEEPER_VAR_DIR / LEASEKEEPER_STORE_URL to a disk with room)")


def store_fit_to_start(process: str, url: str, *, writes: bool) -> None:
    """What a long-running process (``process``: worker, beat, metrics, console) checks of
    its store ``url`` at start: its schema is at this leasekeeper's migration and, when it
    ``writes``, that it takes writes. ConfigError ("leasekeeper <process> not started:
    <what is wrong, the setting, the fix>") on a store it cannot use: no schema, an older
    one, a read-only file or server, a user without UPDATE. A store that does not answer
    yet is no reason to refuse (tasks retry until it does), nor one a newer leasekeeper
    migrated (during a rolling upgrade the old workers still run on it): both are logged."""
    log = logging.getLogger("leasekeeper.preflight")
    try:
        try:
            check_store(url)
        except NewerStore as exc:
            log.warning("%s (this %s starts anyway)", exc, process)
        if writes:
            check_store_writable(url)
    except StoreUnavailable as exc:
        log.warning("%s; the %s starts anyway (it retries until the store answers)",
                    exc, process)
    except ConfigError as exc:
        raise ConfigError(f"leasekeeper {process} not started: {exc}") from None


def refuse_a_store_unfit_to_start(process: str, *, writes: bool) -> None:
    """At a worker's or beat's start (workers/app.py): on a store ``store_fit_to_start``
    refuses, exit at once (code 2) saying what to do, instead of failing every task and
    sweep while it runs (``relation "runs" does not exist``, ``attempt to write a readonly
    database``)."""
    from workers.settings import get_settings

    try:
        store_fit_to_start(process, get_settings().effective_store_url, writes=writes)
    except ConfigError as exc:
        logging.getLogger("leasekeeper.preflight").critical("%s", exc)
        sys.exit(2)


@functools.cache
def migration_script() -> Any:
    """This leasekeeper's migrations (read once: the folder does not change)."""
    from alembic.script import ScriptDirectory

    from models.migrate import MIGRATIONS

    return ScriptDirectory(str(MIGRATIONS))


def migration_heads() -> set[str]:
    return set(migration_script().get_heads())


def _known() -> set[str]:
    return {script.revision for script in migration_script().walk_revisions()}


def current_revisions(url: str) -> set[str]:
    """The migrations the store records (empty: never migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(url, poolclass=NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    except SQLAlchemyError as exc:
        raise store_error(url, exc, "cannot reach") from None
    finally:
        engine.dispose()


def _connect_args(url: str) -> dict[str, object]:
    return {"connect_timeout": 5} if url.startswith("postgresql") else {}


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cannot_listen(what: str, setting: str, host: str, port: int, exc: OSError) -> ConfigError:
    """Why a server (``what``) cannot listen on host:port, naming the setting to change
    (``setting``: the prefix of its _HOST and _PORT variables)."""
    import errno
    import socket

    where = host_port(host, port)
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        fix = f"{setting}_HOST={host!r} is not an address of this machine; set it to one"
    elif exc.errno == errno.EADDRINUSE:
        fix = f"port {port} is in use; set {setting}_PORT to a free port"
    elif exc.errno == errno.EACCES:
        fix = f"ports below 1024 need privileges; set {setting}_PORT to a higher one"
    else:
        fix = f"check {setting}_HOST and {setting}_PORT"
    return ConfigError(f"cannot serve {what} on {where} ({exc.strerror or exc}): {fix}")


# What PostgreSQL says when the server is there but the URL's database, user or password
# is wrong: a setting to fix (exit 2), not a service to wait for.
_WRONG_SETTING = (("does not exist", "create it, or fix the URL"),
                  ("password authentication failed", "fix the user or password in the URL"),
                  ("no password supplied", "put the password in the URL"),
                  ("no pg_hba.conf entry", "allow this host in the server's pg_hba.conf"))

# What PostgreSQL says when the server answers but may not do what was asked (SQLSTATE):
# a setting to fix, not a store to wait for. A failed migration changes nothing on
# PostgreSQL (its DDL is one transaction).
_NOT_ALLOWED: dict[str, Callable[[str], str]] = {
    "25006": lambda _user: READ_ONLY_STORE,  # the same words as a task's (models/store.py)
    "42501": lacks_right,
}


# What libpq says of a URL whose connection options it cannot take (`?sslmode=bogus`,
# `?nosuch=1`, `?connect_timeout=abc`), before it connects to anything.
_BAD_OPTION = re.compile(r"^(connection is bad: )?(invalid (\w+ value|connection option|URI "
                         r"query parameter)|bad value for \w+)")


def store_error(url: str, exc: SQLAlchemyError, doing: str) -> ConfigError | StoreUnavailable:
    """A store error at the command line, in one line: a wrong database, user or password
    is a setting (ConfigError); anything else, the store is unavailable."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip()
    fatal = next((line.split("FATAL:", 1)[1].strip() for line in text.splitlines()
                  if "FATAL:" in line), None)
    if fatal is not None:
        for needle, fix in _WRONG_SETTING:
            if needle in fatal:
                return ConfigError(f"{doing} the store {shown(url)}: the server says "
                                   f"{fatal[:200]!r}: {fix} (LEASEKEEPER_STORE_URL)")
    first = text.splitlines()[0][:200] if text else ""
    if _BAD_OPTION.search(first):  # libpq refused the URL's own options: nothing to wait for
        said = first.removeprefix("connection is bad: ")
        return ConfigError(f"{doing} the store {shown(url)}: {said}: fix that option in "
                           "LEASEKEEPER_STORE_URL")
    if "unable to open database file" in first:  # SQLite's word for any of these
        try:
            sqlite_store_file(url)
        except ConfigError as no_folder:
            return no_folder
        read_only = read_only_sqlite(url)
        if read_only is not None:  # it is there, but SQLite cannot open it: say so
            doing = "cannot open" if doing == "cannot reach" else doing
            return ConfigError(f"{doing} the store {shown(url)}: {read_only}")
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _NOT_ALLOWED:
        who = make_url(url).username or "the URL's user"
        return ConfigError(f"{doing} the store {shown(url)}: the server says {first!r}: "
                           f"{_NOT_ALLOWED[sqlstate](who)} "
                           "(LEASEKEEPER_STORE_URL); nothing was changed")
    return StoreUnavailable(f"{doing} the store {shown(url)} (LEASEKEEPER_STORE_URL): "
                            f"{type(orig).__name__}: {first}")
