"""The lease store: every read and every guarded state change of leases and runs.

Each public method is one short transaction. A state change is decided first, then
written with ``UPDATE ... WHERE state = :expected``; the row count says who won, so two
workers can never both move the same lease. Every lease change appends a LeaseEvent in
the same transaction. Database failures leave here as StoreUnavailable (transient) or
StoreError, never as SQLAlchemy exceptions.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Engine,
    Table,
    create_engine,
    event,
    insert,
    make_url,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

from models.rawsql import Change, RawSql, SessionCursor
from models.schema import (
    FINAL_STATES,
    TERMINAL_RUN_STATUSES,
    ClaimedLease,
    Lease,
    LeaseEvent,
    LeaseRecord,
    LeaseState,
    ReclaimOutcome,
    Run,
    RunStatus,
    utcnow,
)
from models.shown_url import shown_url
from providers.errors import (
    READ_ONLY_SQLITE,
    READ_ONLY_STORE,
    InvalidRequest,
    NotFound,
    RunNotRecorded,
    StoreError,
    StoreNotPermitted,
    StoreReadOnly,
    StoreUnavailable,
    TransientProviderError,
    lacks_right,
)

_LEASES = cast(Table, Lease.__table__)
_EVENTS = cast(Table, LeaseEvent.__table__)
_RUNS = cast(Table, Run.__table__)


def _rowcount(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


UNFINISHED_RUN_STATUSES = (RunStatus.RUNNING, RunStatus.INTERRUPTED)
# How an unavailable store's message ends: what a task does about it (its retry_note). A
# reader that runs no task (the CLI, the console, the exporter) says
# LeasekeeperError.outside_a_task() instead.
TASK_WILL_RETRY = "; the task will retry"


def leaseless(started_by: datetime | None = None) -> list[ColumnElement[bool]]:
    """A run still running with no lease (started at or before ``started_by``): the one
    predicate of `Store.fail_leaseless_run`, sweep.reap_runs and `leasekeeper check`
    (partial index ix_runs_leaseless)."""
    found = [_RUNS.c.status == RunStatus.RUNNING, _RUNS.c.lease_id.is_(None)]
    return found if started_by is None else [*found, _RUNS.c.started_at <= started_by]


def failed_run(error: str) -> dict[str, Any]:
    """The values that fail a run that never had a sandbox (nothing to reclaim)."""
    return {"status": RunStatus.FAILED, "finished_at": utcnow(), "reclaim_due": False,
            "error": error[:2000]}


class LiveLeaseExists(StoreError):
    """Another live lease holds this sandbox key."""


class RunRebound(StoreError):
    """The run was bound to another lease after this acquire read it (another copy of
    the run's acquire, sent at once, bound its sandbox first): nothing was written."""


def run_bindable(bound_lease: str | None, lease_id: str | None) -> list[ColumnElement[bool]]:
    """The runs row may be bound to a lease: it has none, or still the one the acquire
    read (``bound_lease``: an ended lease of the thread), or already this very one (a
    twin bound the same). A compare-and-set: a twin's bind in between makes it false."""
    ok: list[ColumnElement[bool]] = [_RUNS.c.lease_id.is_(None)]
    ok += [_RUNS.c.lease_id == b for b in (bound_lease, lease_id) if b is not None]
    return [or_(*ok)]


@dataclass(frozen=True)
class RunEnd:
    """How the runs on a lease end when its sandbox's command ended by itself."""

    status: RunStatus
    exit_code: int | None
    error: str | None


class RunChange(StrEnum):
    CHANGED = "changed"
    UNCHANGED = "unchanged"  # already in the asked-for state, or moved on: idempotent no-op


@dataclass(frozen=True)
class NewLease:
    lease_id: str
    sandbox_key: str
    provider: str
    provider_lease_id: str
    reuse: bool
    tenant: str
    thread_id: str | None
    run_id: str
    spec: dict[str, Any]
    acquire_deadline_at: datetime
    deadline_at: datetime
    idle_timeout_s: int
    pool: str | None = None  # the warm pool its run asked for (it was empty: a cold start)


WAL_CHECKPOINT_PAGES = 4000


def make_engine(url: str, statement_timeout_s: float = 60.0, pre_ping: bool = False) -> Engine:
    """The store's engine. On PostgreSQL a statement runs at most ``statement_timeout_s``
    (the server's ``statement_timeout``: a statement stuck on a lock, say, is cancelled and
    the task retries) and TCP keepalives find a server whose host went away while a
    statement waited; the hot path also stops waiting for an answer a little later
    (models/pq_cursor.py), for a server that is there but does not answer."""
    if url.startswith("sqlite"):
        # A small pool per process (the runtime is rebuilt after a fork), so the pragmas
        # below run once per connection, not once per transaction.
        engine = create_engine(
            url, poolclass=QueuePool, pool_size=2, max_overflow=4,
            connect_args={"timeout": 30, "check_same_thread": False},
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # let BEGIN below be the only transaction
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout=30000")
            # WAL is a property of the file: set once, by the first connection ever.
            # Setting it again takes a lock that fails at once ("database is locked")
            # when another process is connecting at the same moment.
            if cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            # A checkpoint (the WAL copied into the database, two fsyncs) every 4,000
            # pages written rather than SQLite's 1,000: a lease's hot pages are written
            # many times between two, copied once by each (16 MB of WAL at most, between
            # checkpoints; bench: 3-6% less CPU per acquire+destroy pair)
            cur.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn: Any) -> None:
            # Take the write lock up front: no deadlocking lock upgrades between workers.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # No pre-ping for the workers (a round trip per transaction): after a database
    # restart, the first statement on a dead connection fails as StoreUnavailable (retried
    # by the task policy) and SQLAlchemy invalidates the whole pool, so only that one
    # attempt is lost. A reader that retries nothing (the console, the exporter) pings:
    # its page or scrape would be that lost attempt.
    timeout_ms = max(round(statement_timeout_s * 1000), 1)
    engine = create_engine(url, pool_size=5, max_overflow=5, pool_recycle=1800,
                           pool_pre_ping=pre_ping,
                           connect_args=pg_connect_args(url, timeout_ms))

    @event.listens_for(engine, "connect")
    def _statement_timeout(dbapi_conn: Any, _record: Any) -> None:
        # SET, not a startup option: poolers such as PgBouncer refuse startup options
        with dbapi_conn.cursor() as cur:
            cur.execute("SELECT set_config('statement_timeout', %s, false)",
                        (f"{timeout_ms}ms",))
        dbapi_conn.commit()

    @event.listens_for(engine, "checkin")
    def _transactions_again(dbapi_conn: Any, _record: Any) -> None:
        # A hot-path connection (autocommit, see Store._hot) back in the pool, however it
        # got there (its thread ended, say), must not give a session autocommit: a
        # session's SELECT ... FOR UPDATE would lock nothing past its own statement.
        if getattr(dbapi_conn, "autocommit", False):
            with contextlib.suppress(Exception):  # a dead connection: the pool drops it
                dbapi_conn.autocommit = False

    return engine


def pg_connect_args(url: str, statement_timeout_ms: int) -> dict[str, Any]:
    """libpq's connection options (those the URL sets itself win): give up a connect
    after 5 s; keepalive probes on a quiet connection after 10 s, every 5 s; and the
    kernel drops a connection whose data or probes go unacknowledged for the statement
    timeout (TCP_USER_TIMEOUT, which also bounds the keepalives): a statement waiting on a
    host that went away without a reset fails after about that long."""
    if not url.startswith("postgresql"):
        return {}
    given = make_url(url).query
    options = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10,
               "keepalives_interval": 5, "keepalives_count": 3,
               "tcp_user_timeout": statement_timeout_ms}
    # psycopg's, not libpq's: sessions and migrations never prepare (psycopg would after a
    # query's 5th run, as _pg3_N: behind a pooler in transaction mode that name may be
    # missing on the next server connection, or be another client's statement). The hot
    # path prepares its own, under names a pooled server cannot confuse (pq_cursor.py).
    return {**{name: value for name, value in options.items() if name not in given},
            "prepare_threshold": None}


# How much longer than the statement timeout the hot path waits for an answer: the
# server cancels first, and says so, when it can.
ANSWER_GRACE_S = 5.0
# A kept hot-path connection is returned to the pool and replaced after this long, as
# the pool recycles its own (PostgreSQL: pool_recycle).
HOT_RECYCLE_S = 1800.0


@dataclass
class _HotConnection:
    conn: PoolProxiedConnection
    driver: Any  # conn's DBAPI connection (commit and rollback without the pool's proxy)
    cursor: Any
    since_s: float
    # SQLite: this thread's own open of the store's writer lock file (see raw_tx)
    writer_lock: int | None = None


class _RawTx:
    """What :meth:`Store.raw_tx` returns: a plain context manager (every lifecycle task
    runs a few of these; a generator-based one costs several calls more each)."""

    __slots__ = ("hot", "store")

    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> Any:
        store = self.store
        hot = self.hot = store._hot()
        if hot.writer_lock is not None:
            fcntl.flock(hot.writer_lock, fcntl.LOCK_EX)
        if not store.raw.pg:
            try:
                hot.cursor.execute("BEGIN IMMEDIATE")
            except BaseException as exc:
                raise (self._failed(exc) or exc) from None
        return hot.cursor

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> None:
        if exc is None:
            if not self.store.raw.pg:
                try:
                    self.hot.driver.commit()
                except BaseException as failed:
                    raise (self._failed(failed) or failed) from None
            self._unlock()
            return
        translated = self._failed(exc)
        if translated is not None:
            raise translated from None
        # else the original goes on

    def _unlock(self) -> None:
        if self.hot.writer_lock is not None:
            fcntl.flock(self.hot.writer_lock, fcntl.LOCK_UN)

    def _failed(self, exc: BaseException) -> BaseException | None:
        """Roll back (or drop the connection), release the writer lock; what to raise
        instead of ``exc`` (StoreUnavailable, StoreError), or None to let ``exc`` go on
        (the driver's IntegrityError, for the caller to decide; anything not the
        database's)."""
        store, hot = self.store, self.hot
        dbapi = store.dbapi
        try:
            broken = isinstance(exc, dbapi.Error) and store.engine.dialect.is_disconnect(
                exc, hot.driver, hot.cursor)
            # closed: PqCursor closes a connection whose statement it stopped waiting for
            if broken or not isinstance(exc, Exception) or getattr(hot.driver, "closed",
                                                                     False):
                store._drop_hot(hot, invalidate=True)
            elif not store.raw.pg:
                try:
                    hot.driver.rollback()
                except dbapi.Error:
                    store._drop_hot(hot, invalidate=True)
        finally:
            self._unlock()
        if isinstance(exc, dbapi.IntegrityError) or not isinstance(exc, dbapi.Error):
            return None
        translated = store._translated(
            exc, isinstance(exc, dbapi.OperationalError | dbapi.InterfaceError) or broken)
        if isinstance(translated, StoreUnavailable):  # gone, or read-only: connect anew
            store._drop_hot(hot, invalidate=True)
        return translated


class Store:
    def __init__(self, url: str, statement_timeout_s: float = 60.0,
                 prepared_statements: bool = True, pre_ping: bool = False) -> None:
        self.url = url
        self.statement_timeout_s = statement_timeout_s
        # PostgreSQL's hot path: prepare its statements (False: a pooler in transaction
        # mode; LEASEKEEPER_STORE_PREPARED_STATEMENTS)
        self.prepared_statements = prepared_statements
        # pre_ping: each checkout checks its connection first (readers that retry nothing)
        self.engine = make_engine(url, statement_timeout_s, pre_ping)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._skip_locked = self.engine.dialect.name == "postgresql"
        self.raw = RawSql(self.engine.dialect.name)
        self.dbapi: Any = self.engine.dialect.dbapi  # the driver module, for its errors
        self._local = threading.local()

    def dispose(self) -> None:
        hot = getattr(self._local, "hot", None)
        if hot is not None:
            self._drop_hot(hot)
        self.engine.dispose()

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction; database errors are translated at this boundary."""
        try:
            with self._sessions.begin() as session:
                yield session
        except IntegrityError:
            raise
        except (OperationalError, DBAPIError) as exc:
            raise self._translated(exc.orig or exc, isinstance(exc, OperationalError)
                                   or exc.connection_invalidated) from None
        except SQLAlchemyError as exc:
            raise StoreError(f"lease store error: {exc!s:.300}") from None

    def _translated(self, orig: BaseException, unavailable: bool) -> StoreError:
        """The one translation of a driver's error, for both paths (:meth:`tx`, and the
        hot path's ``_RawTx._failed``): a refused write first (:meth:`_refused`), then
        StoreUnavailable if ``unavailable`` (the connection failed or went away), else
        StoreError."""
        refused = self._refused(orig)
        if refused is not None:
            return refused
        if unavailable:
            return self._unavailable(orig)
        return StoreError(f"lease store error: {str(orig)[:300]}")

    def _refused(self, orig: BaseException) -> StoreReadOnly | StoreNotPermitted | None:
        """A store that answers but will not do this, said the way preflight says it at a
        worker's start (the wording is shared: providers/errors.py, which also explains
        the retry decision): read-only (PostgreSQL 25006, SQLite's SQLITE_READONLY) is
        StoreReadOnly, retried; a missing right (42501) is StoreNotPermitted, not retried.
        None for any other error. A read-only answer also drops the pool's connections:
        each keeps the default_transaction_read_only it connected with, so a retry must
        connect anew (the hot path drops its own connection: ``_RawTx._failed``)."""
        sqlstate = getattr(orig, "sqlstate", None)
        sqlite_read_only = str(getattr(orig, "sqlite_errorname", "")).startswith(
            "SQLITE_READONLY") or "readonly database" in str(orig)
        if sqlstate not in ("25006", "42501") and not (
                sqlite_read_only and not self.raw.pg):
            return None
        said = " ".join(str(orig).split()).removeprefix("ERROR: ")[:200]
        where = shown_url(self.engine.url)  # never a password
        refusal = f"the lease store at {where} refused ({type(orig).__name__}: {said})"
        if sqlstate == "42501":
            user = self.engine.url.username or "the URL's user"
            denied = re.search(r"permission denied for (\w+) \"?([\w.]+)", said)
            on = (None if denied is None else
                  f"{denied[1].replace('relation', 'table')} {denied[2]}")
            return StoreNotPermitted(
                f"{refusal}: {lacks_right(user, on)} (the store needs SELECT, INSERT, "
                "UPDATE and DELETE on all its tables, and USAGE on their sequences); not "
                "retried: a missing right does not come back by itself")
        self.engine.dispose()
        fix, until = ((READ_ONLY_STORE, "a failover ends") if self.raw.pg else (
            READ_ONLY_SQLITE.format(path=(self.engine.url.database or "").removeprefix(
                "file:")), "until the file is writable"))
        return StoreReadOnly(f"{refusal}: {fix}", f"; the task will retry with backoff ({until}), "
                             "and fails with this message if it outlasts the retries")

    def _unavailable(self, orig: BaseException) -> StoreUnavailable:
        said = " ".join(str(orig).split())[:200]
        limit = (f" (LEASEKEEPER_STORE_STATEMENT_TIMEOUT_S is {self.statement_timeout_s:g} s)"
                 if "statement timeout" in said else "")
        return StoreUnavailable(
            f"the lease store at {shown_url(self.engine.url)}"
            f" is unavailable ({type(orig).__name__}: {said}){limit}", TASK_WILL_RETRY)

    def _hot(self) -> _HotConnection:
        """This thread's connection for the plain-SQL path, checked out of the pool once
        and kept (a checkout per statement cost more than the statement on PostgreSQL);
        in autocommit on PostgreSQL; replaced after a failure or after pool_recycle."""
        hot: _HotConnection | None = getattr(self._local, "hot", None)
        if hot is not None and hot.conn.dbapi_connection is not None and (
                time.monotonic() - hot.since_s < HOT_RECYCLE_S):
            return hot
        if hot is not None:
            self._drop_hot(hot)
        # The pool's connect is not SQLAlchemy's Connection: the driver's own error (a
        # refused connection while PostgreSQL restarts) comes out as it is. Translated
        # here, so the task retries it like any other StoreUnavailable.
        try:
            conn = self.engine.raw_connection()
        except SQLAlchemyError as exc:
            raise self._unavailable(getattr(exc, "orig", None) or exc) from None
        except self.dbapi.Error as exc:
            raise self._translated(exc, unavailable=True) from None
        cursor: Any
        if self.raw.pg:
            from models.pq_cursor import PqCursor  # psycopg: installed with PostgreSQL

            try:
                conn.driver_connection.autocommit = True  # type: ignore[union-attr]
            except self.dbapi.Error as exc:  # the new connection died already
                with contextlib.suppress(Exception):
                    conn.invalidate()
                raise self._translated(exc, unavailable=True) from None
            cursor = PqCursor(conn.driver_connection,  # type: ignore[arg-type]
                              self.statement_timeout_s + ANSWER_GRACE_S,
                              prepare=self.prepared_statements)
        else:
            cursor = conn.cursor()
        hot = _HotConnection(conn, conn.driver_connection, cursor, time.monotonic(),
                             self._open_writer_lock())
        self._local.hot = hot
        return hot

    def _open_writer_lock(self) -> int | None:
        """SQLite in a file: an fd of ``<store>.writers``, which the hot path's writers
        flock around their transaction. SQLite's own wait for its write lock is a busy
        handler that sleeps 1, 2, 5, 10 ... ms between tries, so two workers' processes
        that collide on a 0.2 ms transaction lose milliseconds; a flock waiter wakes the
        moment the lock is released. Writers that do not take it (sessions, other
        programs) are still ordered by SQLite itself: this only makes waits short."""
        from models.migrate import sqlite_file

        database = None if self.raw.pg else sqlite_file(self.url)
        if database is None:
            return None
        try:
            return os.open(f"{database}.writers", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None  # a read-only folder: SQLite's own wait only

    def _drop_hot(self, hot: _HotConnection, invalidate: bool = False) -> None:
        self._local.hot = None
        if hot.writer_lock is not None:
            lock, hot.writer_lock = hot.writer_lock, None  # closed once, whoever asks again
            with contextlib.suppress(OSError):
                os.close(lock)
        with contextlib.suppress(Exception):  # a dead connection may fail in any way here
            if invalidate:
                hot.conn.invalidate()
            else:
                if self.raw.pg and hot.conn.is_valid:
                    hot.conn.driver_connection.autocommit = False  # type: ignore[union-attr]
                hot.conn.close()

    def raw_tx(self) -> contextlib.AbstractContextManager[Any]:
        """A DBAPI cursor for the plain-SQL hot path (models/rawsql.py): on SQLite, one
        ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction; on PostgreSQL, ONE statement, in
        autocommit (its own transaction: one round trip, no BEGIN/COMMIT). Errors are
        translated as in :meth:`tx`; the driver's IntegrityError passes through (after
        the rollback) for the caller to decide."""
        return _RawTx(self)

    # -- reads -------------------------------------------------------------------------
    def get_lease(self, lease_id: str) -> Lease:
        with self.tx() as s:
            lease = s.get(Lease, lease_id)
        if lease is None:
            raise NotFound(f"no lease {lease_id!r} in the store; check the id")
        return lease

    def find_lease(self, lease_id: str) -> Lease | None:
        with self.tx() as s:
            return s.get(Lease, lease_id)

    def get_run(self, run_id: str) -> Run | None:
        with self.tx() as s:
            return s.get(Run, run_id)

    def live_lease_for_key(self, sandbox_key: str) -> Lease | None:
        with self.tx() as s:
            return s.scalar(select(Lease).where(Lease.live_key == sandbox_key))

    def events(self, lease_id: str) -> list[LeaseEvent]:
        with self.tx() as s:
            return list(
                s.scalars(
                    select(LeaseEvent).where(LeaseEvent.lease_id == lease_id)
                    .order_by(LeaseEvent.id)
                )
            )

    def leases(self, states: Iterable[str] | None = None) -> list[Lease]:
        with self.tx() as s:
            query = select(Lease).order_by(Lease.created_at)
            if states is not None:
                query = query.where(Lease.state.in_(list(states)))
            return list(s.scalars(query))

    def unfinished_runs_on_leases(self, lease_ids: Sequence[str]) -> list[tuple[Lease, Run]]:
        """Every run bound to a lease among ``lease_ids`` that is still running or
        interrupted, with its lease: not only the lease's latest run (``Lease.run_id``), as
        the runs of a thread that reuse one sandbox are all bound to it (``Run.lease_id``,
        ix_runs_lease_id). Oldest lease first, and its runs oldest first."""
        found: list[tuple[Lease, Run]] = []
        with self.tx() as s:
            for start in range(0, len(lease_ids), 500):
                chunk = list(lease_ids[start:start + 500])
                found.extend((lease, run) for lease, run in s.execute(
                    select(Lease, Run).join(Run, Run.lease_id == Lease.lease_id)
                    .where(Lease.lease_id.in_(chunk),
                           Run.status.in_([RunStatus.RUNNING, RunStatus.INTERRUPTED]))
                    .order_by(Lease.created_at, Run.started_at, Run.run_id)
                ))
        return found

    def other_unfinished_runs(self, lease_id: str, run_id: str) -> list[str]:
        """Runs other than ``run_id`` bound to the lease and not terminal (running or
        interrupted: a paused run still needs its sandbox), oldest first."""
        with self.tx() as s:
            return list(s.scalars(
                select(Run.run_id).where(Run.lease_id == lease_id, Run.run_id != run_id,
                                         Run.status.in_(UNFINISHED_RUN_STATUSES))
                .order_by(Run.started_at)))

    # -- runs --------------------------------------------------------------------------
    def start_run(
        self, run_id: str, thread_id: str | None, provider: str, sandbox_key: str,
        secret_env_given: bool = False,
    ) -> Run:
        """Insert the run if it is new; return the stored row either way (idempotent):
        one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` (plain SQL: every acquire that
        is not a new run's own sandbox starts here), a read only if the run existed.
        ``secret_env_given``: its acquire carried secret_env (tasks/secret_marks.py)."""
        now = utcnow()
        with self.raw_tx() as cur:
            row = self.raw.insert_run(cur, run_id, thread_id, provider, sandbox_key, now,
                                      secret_env_given)
        if row is not None:
            return Run(run_id=run_id, thread_id=thread_id, status=RunStatus.RUNNING,
                       provider=provider, sandbox_key=sandbox_key, started_at=now,
                       cancel_requested=False, reclaim_due=False, exit_code=None,
                       lease_id=None, finished_at=None, detached_since=None, error=None,
                       reclaim_claimed_until=None, reclaim_outcome=None, reclaimed_at=None,
                       secret_env_given=secret_env_given)
        run = self.get_run(run_id)
        if run is None:  # deleted behind the store's back between the two: insert it now
            return self.start_run(run_id, thread_id, provider, sandbox_key, secret_env_given)
        return run

    def secrets_given(self, run_id: str | None, lease_id: str | None) -> bool:
        """Whether the run, or any run bound to the lease (a shared sandbox's runs), was
        given secret_env by its acquire: one indexed read, made only when a run's secret
        marks are found lost (tasks/secret_marks.py)."""
        bound = [c for c in (_RUNS.c.run_id == run_id if run_id else None,
                             _RUNS.c.lease_id == lease_id if lease_id else None)
                 if c is not None]
        if not bound:
            return False
        with self.tx() as s:
            return s.scalar(select(_RUNS.c.run_id).where(
                _RUNS.c.secret_env_given.is_(True), or_(*bound)).limit(1)) is not None

    def bind_run(self, run_id: str, lease_id: str, sandbox_key: str,
                 bound_lease: str | None = None) -> None:
        """Bind a running run to an active lease (a reuse), both or neither: a run that
        ended meanwhile (its run.finish came first) is not given a sandbox it would hold
        the lease's run_id on; a lease that ended meanwhile is not handed to a run; a run
        another copy of its acquire bound to another lease since it was read
        (``bound_lease``: the lease it had then) raises RunRebound."""
        with self.tx() as s:
            bound = s.execute(update(_RUNS).where(_RUNS.c.run_id == run_id,
                                                  _RUNS.c.status == RunStatus.RUNNING,
                                                  *run_bindable(bound_lease, lease_id))
                              .values(lease_id=lease_id, sandbox_key=sandbox_key))
            if _rowcount(bound) != 1:
                run = s.get(Run, run_id)
                if run is None:
                    raise NotFound(f"no run {run_id!r}; acquire a lease for it first")
                if run.status == RunStatus.RUNNING:
                    raise RunRebound(f"run {run_id} was bound to lease {run.lease_id} "
                                     "meanwhile")
                raise InvalidRequest(f"run {run_id} is {run.status}; start a new run to get "
                                     "a sandbox")
            moved = s.execute(update(Lease).where(Lease.lease_id == lease_id,
                                                  Lease.state == LeaseState.ACTIVE)
                              .values(run_id=run_id, updated_at=utcnow()))
            if _rowcount(moved) != 1:  # rolls the run's bind back too
                raise TransientProviderError(
                    f"lease {lease_id} ended while run {run_id} was being bound to it; "
                    "retrying, to reuse the thread's live sandbox or acquire a fresh one")

    def finish_run(
        self, run_id: str, status: RunStatus, exit_code: int | None, error: str | None,
        reclaim_due: bool, claim_until: datetime | None,
    ) -> RunChange:
        if status not in TERMINAL_RUN_STATUSES and status != RunStatus.INTERRUPTED:
            raise InvalidRequest(f"run status {status!r} is not a finishing status")
        with self.tx() as s:
            if s.get(Run, run_id) is None:
                raise RunNotRecorded.of(run_id, "finish")
            values: dict[str, Any] = {"status": status, "exit_code": exit_code, "error": error}
            if status in TERMINAL_RUN_STATUSES:
                values |= {"finished_at": utcnow(), "reclaim_due": reclaim_due,
                           "reclaim_claimed_until": claim_until}
            result = s.execute(
                update(Run).where(Run.run_id == run_id,
                                  Run.status.in_([RunStatus.RUNNING, RunStatus.INTERRUPTED]))
                .values(**values)
            )
            return RunChange.CHANGED if _rowcount(result) == 1 else RunChange.UNCHANGED

    def fail_leaseless_run(self, run_id: str, error: str) -> RunChange:
        """Fail the run if it is still running with no lease: its acquire gave up before
        recording one (a run with a lease is settled by what happens to that lease)."""
        with self.tx() as s:
            result = s.execute(update(Run).where(Run.run_id == run_id, *leaseless())
                               .values(**failed_run(error)))
            return RunChange.CHANGED if _rowcount(result) == 1 else RunChange.UNCHANGED

    def set_detached(self, run_id: str, detached: bool) -> RunChange:
        with self.tx() as s:
            if s.get(Run, run_id) is None:
                raise RunNotRecorded.of(run_id, "detach or attach")
            # Only a real change writes: a repeated detach keeps the first detached_since
            # (a redelivery never postpones the reap), an attach of an attached run is a no-op.
            state = Run.detached_since.is_(None) if detached else Run.detached_since.isnot(None)
            result = s.execute(
                update(Run).where(Run.run_id == run_id, Run.status == RunStatus.RUNNING, state)
                .values(detached_since=utcnow() if detached else None)
            )
            return RunChange.CHANGED if _rowcount(result) == 1 else RunChange.UNCHANGED

    def record_reclaim(self, run_id: str, outcome: str) -> str:
        """Record a reclaim's outcome; returns the outcome recorded. A ``destroy-failed``
        whose lease another destroy has destroyed meanwhile is recorded ``destroyed``: the
        lease row is read under a share lock (PostgreSQL; SQLite's write lock already
        orders them), so either that destroy's transition comes first and is seen here, or
        it comes after and corrects this outcome itself (models/rawsql.py)."""
        with self.tx() as s:
            if outcome == ReclaimOutcome.DESTROY_FAILED:
                lease_id = s.scalar(select(Run.lease_id).where(Run.run_id == run_id))
                query = select(Lease.state).where(Lease.lease_id == lease_id)
                if self._skip_locked:
                    query = query.with_for_update(read=True)
                if lease_id is not None and s.scalar(query) == LeaseState.DESTROYED:
                    outcome = ReclaimOutcome.DESTROYED
            s.execute(update(Run).where(Run.run_id == run_id)
                      .values(reclaim_outcome=outcome, reclaimed_at=utcnow(),
                              reclaim_claimed_until=None))
        return outcome

    # -- leases ------------------------------------------------------------------------
    def create_intent(self, new: NewLease, task_id: str | None,
                      bound_lease: str | None = None) -> Lease:
        """Record the lease, with the provider name it will use, before anything exists,
        and bind its run to it. Nothing is written if the run ended (InvalidRequest) or
        was bound to another lease than ``bound_lease`` (the run's lease when the acquire
        read it) meanwhile (RunRebound: another copy of the acquire bound it first)."""
        now = utcnow()
        try:
            with self.tx() as s:
                row = s.execute(insert(_LEASES).values(
                    lease_id=new.lease_id, sandbox_key=new.sandbox_key,
                    live_key=new.sandbox_key, provider=new.provider,
                    provider_lease_id=new.provider_lease_id, backend=None, provider_meta={},
                    state=LeaseState.PROVISIONING, reuse=new.reuse, tenant=new.tenant,
                    thread_id=new.thread_id, run_id=new.run_id, spec=new.spec,
                    created_at=now, updated_at=now, acquire_deadline_at=new.acquire_deadline_at,
                    deadline_at=new.deadline_at, idle_timeout_s=new.idle_timeout_s,
                    pool=new.pool,
                ).returning(*_LEASES.c)).one()
                s.execute(insert(_EVENTS).values(
                    lease_id=new.lease_id, at=now, from_state=None,
                    to_state=LeaseState.PROVISIONING,
                    reason=f"intent recorded for run {new.run_id}", task_id=task_id))
                bound = s.execute(update(_RUNS).where(
                    _RUNS.c.run_id == new.run_id, _RUNS.c.status == RunStatus.RUNNING,
                    *run_bindable(bound_lease, new.lease_id))
                    .values(lease_id=new.lease_id, sandbox_key=new.sandbox_key))
                run = (None if _rowcount(bound) == 1 or new.run_id is None
                       else s.get(Run, new.run_id))
                if run is not None and run.status == RunStatus.RUNNING:
                    raise RunRebound(f"run {new.run_id} was bound to lease {run.lease_id} "
                                     "meanwhile")  # rolls the intent back
                if run is not None:
                    # the run ended meanwhile (sweep.reap_runs failed it): write nothing
                    raise InvalidRequest(f"run {new.run_id} is no longer running; start a "
                                         "new run to get a sandbox")
        except IntegrityError:
            raise LiveLeaseExists(
                f"sandbox key {new.sandbox_key!r} already has a live lease"
            ) from None
        return Lease(**row._mapping)

    def start_run_with_intent(self, run_id: str, new: NewLease,
                              task_id: str | None) -> bool:
        """A new run and its lease intent in one transaction (one statement on
        PostgreSQL): the common acquire. True if written, as ``new`` says (provisioning,
        version 1, no provider meta yet); False, with nothing written, if the run already
        exists (the caller takes the general path); LiveLeaseExists if the key has a live
        lease (nothing written either: not even the run)."""
        if new.run_id != run_id:
            raise ValueError(f"the intent of run {run_id} names run {new.run_id}")
        now = utcnow()
        intent = {"run_id": run_id, "lease_id": new.lease_id, "thread_id": new.thread_id,
                  "provider": new.provider, "sandbox_key": new.sandbox_key,
                  "provider_lease_id": new.provider_lease_id, "reuse": new.reuse,
                  "tenant": new.tenant, "spec": new.spec,
                  "acquire_deadline_at": new.acquire_deadline_at,
                  "deadline_at": new.deadline_at, "idle_timeout_s": new.idle_timeout_s,
                  "pool": new.pool, "secret_env_given": bool(new.spec.get("secret_env"))}
        try:
            with self.raw_tx() as cur:
                return self.raw.start_run_with_intent(
                    cur, intent, f"intent recorded for run {run_id}", task_id, now)
        except self.dbapi.IntegrityError:
            raise LiveLeaseExists(
                f"sandbox key {new.sandbox_key!r} already has a live lease") from None

    def transition(
        self,
        lease_id: str,
        expected: Iterable[str],
        to: LeaseState,
        reason: str,
        task_id: str | None = None,
        first_end_reason: str | None = None,
        *,
        guard: str = "",
        guard_params: Mapping[str, Any] | None = None,
        **values: Any,
    ) -> LeaseRecord | None:
        """Move a lease from one of ``expected`` to ``to``; None if another worker won.

        The hot path of every task: plain SQL (models/rawsql.py), one transaction: the
        guarded ``UPDATE ... WHERE state = :from``, the runs a lease end settles, and the
        event, which names the state the lease really left (one statement and one round
        trip on PostgreSQL). ``first_end_reason`` sets end_reason only if the lease has
        none; ``guard`` is an extra SQL condition over the lease row (``guard_params``:
        its parameters, named ``g_*``). The returned LeaseRecord is detached, for reading.
        """
        change = Change(lease_id, frozenset(expected), to, reason, task_id, values,
                        first_end_reason, guard, guard_params)
        with self.raw_tx() as cur:
            return self.raw.transition(cur, change, utcnow())

    def claim_to_destroy(self, lease_id: str, expected: Iterable[str], reason: str,
                         task_id: str | None, first_end_reason: str,
                         bound_to: str | None = None) -> ClaimedLease | None:
        """The destroy's claim: :meth:`transition` to destroying, reading back only what
        the destroy needs of the lease (its provider, handle and attempts); with
        ``bound_to``, only while the lease is still bound to that run (a reuse binds it to
        another run by writing the lease row, so the claim's guard sees it: on PostgreSQL
        the claim waits for the binding transaction, then checks the row it committed)."""
        guard, params = ("run_id = :bound_to", {"bound_to": bound_to}) if bound_to else ("", None)
        change = Change(lease_id, frozenset(expected), LeaseState.DESTROYING, reason,
                        task_id, {}, first_end_reason, guard, params)
        with self.raw_tx() as cur:
            return self.raw.claim(cur, change, utcnow())

    def move(self, lease_id: str, expected: Iterable[str], to: LeaseState, reason: str,
             task_id: str | None = None, first_end_reason: str | None = None,
             **values: Any) -> bool:
        """:meth:`transition` for a caller that needs no row back (the acquire's
        activation, the destroy's end): whether the lease moved; the same change, event
        and settlement, without reading the row."""
        change = Change(lease_id, frozenset(expected), to, reason, task_id, values,
                        first_end_reason)
        with self.raw_tx() as cur:
            return self.raw.move(cur, change, utcnow())

    def move_ending_runs(self, lease_id: str, expected: Iterable[str], to: LeaseState,
                         reason: str, task_id: str | None, ended: RunEnd,
                         **values: Any) -> bool:
        """:meth:`move`, for a lease whose command ended by itself: if (and only if) the
        lease moved, every run still running or interrupted on it is finished as ``ended``
        says, in the same transaction, as sweep.finish_exited would finish it; its later
        end then finds no run to abort. Not for a final state (that change aborts its runs
        itself). No reclaim is due: the caller destroys the lease."""
        if to in FINAL_STATES:
            raise ValueError(f"a change to {to} settles its runs itself")
        change = Change(lease_id, frozenset(expected), to, reason, task_id, values)
        with self.tx() as s:
            now = utcnow()
            if not self.raw.move(SessionCursor(s.connection()), change, now):
                return False
            s.execute(update(Run).where(Run.lease_id == lease_id,
                                        Run.status.in_(UNFINISHED_RUN_STATUSES))
                      .values(status=ended.status, exit_code=ended.exit_code,
                              error=ended.error, finished_at=now, reclaim_due=False,
                              reclaim_claimed_until=None))
            return True

    def extend_acquire_deadline(self, run_id: str, until: datetime) -> int:
        """Push the acquire deadline of the run's provisioning lease out to ``until``.

        A retried or redelivered acquire is still at work: ``sweep.stuck_provisioning`` must
        not take its lease meanwhile. Returns the number of leases moved (0 or 1).
        """
        with self.tx() as s:
            return _rowcount(s.execute(
                update(_LEASES).where(_LEASES.c.run_id == run_id,
                                      _LEASES.c.state == LeaseState.PROVISIONING)
                .values(acquire_deadline_at=until)))

    def touch(self, lease_id: str) -> Lease | None:
        """Record activity: move the idle deadline of an active lease. None (nothing
        moved) for a lease that is not active, or past its absolute deadline (expired:
        activity never saves it from that one; sweep.expire_leases ends it)."""
        with self.tx() as s:
            lease = s.get(Lease, lease_id)
            if lease is None:
                raise NotFound(f"no lease {lease_id!r} in the store")
            if lease.state != LeaseState.ACTIVE:
                return None
            now = utcnow()  # past the absolute deadline: the guard below moves nothing
            moved = s.execute(update(Lease).where(Lease.lease_id == lease_id,
                                                  Lease.state == LeaseState.ACTIVE,
                                                  Lease.deadline_at > now)
                              .values(idle_deadline_at=now + timedelta(
                                  seconds=lease.idle_timeout_s), updated_at=now))
            if _rowcount(moved) != 1:
                return None
        return self.get_lease(lease_id)

    # The sweeps' reads and claims live in models/sweep_store.py.
