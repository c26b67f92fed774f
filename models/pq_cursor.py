"""The hot path's cursor on PostgreSQL: each statement prepared once per connection and
run by libpq through psycopg's ``pq`` layer, its parameters and rows adapted by psycopg's
own ``Transformer`` (the C-accelerated adapters every psycopg cursor uses).

psycopg's cursor spends about 30 us of CPU per statement on top of libpq and its adapters
(a generator-driven wait loop, a transformer built per result, preparation bookkeeping);
the lifecycle's hot statements (models/rawsql.py) are four per acquire+destroy, of a few
shapes. This cursor does what RawSql asks of a DBAPI cursor, for those statements only
(``execute`` with ``%(name)s`` parameters, ``fetchone``, ``fetchall``); sessions and
everything else keep psycopg's own cursors. Parameters are typed and values converted
exactly as psycopg's cursor does it.

Errors stay psycopg's, so the store's translation (models/store.py) is unchanged: a
failed statement raises psycopg's class for its SQLSTATE (a unique violation is an
``IntegrityError``), a lost or failed connection ``OperationalError``.

Behind a pooler in transaction mode (PgBouncer before 1.21) each autocommit statement
may run on another server connection than the one that prepared it. Statement names are
digests of the statement and its parameter types, so a name already there (42P05) is the
same statement, whoever prepared it; ``prepare=False`` (LEASEKEEPER_STORE_PREPARED_
STATEMENTS=false) sends every statement unprepared; left on, the first "prepared
statement does not exist" (26000: the statement did not run) turns preparing off for the
whole process, with one warning, and the statement is sent again unprepared.

The answer is waited for with ``poll`` and a monotonic deadline, not inside libpq's
blocking exec: a server that stops answering (frozen, or its host gone without a reset)
fails the statement once the deadline passes, and a signal handler's exception (Celery's
soft time limit) interrupts the wait at once. Either way the connection still has the
statement in flight, so it is closed: the store drops it and the next call connects anew.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import select
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from psycopg import Connection, OperationalError, errors, pq
from psycopg.adapt import PyFormat, Transformer

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
# SQLSTATEs a pooler in transaction mode causes: the statement named is not prepared on
# this server connection (it did not run), or a statement of that name already is
NOT_PREPARED_HERE = b"26000"
ALREADY_PREPARED = b"42P05"

log = logging.getLogger("leasekeeper.store")


class _Preparing:
    """Whether this process still prepares (off for good after the first 26000)."""

    on = True


def statement_name(query: bytes, types: tuple[int, ...]) -> bytes:
    """A prepared statement's name: a digest of its text and parameter types, the same in
    every process (another client's statement of this name on a pooled server connection
    is this statement)."""
    digest = hashlib.blake2b(query + repr(types).encode(), digest_size=12).hexdigest()
    return f"lk_{digest}".encode()


@functools.lru_cache(maxsize=256)
def positional(statement: str) -> tuple[bytes, tuple[str, ...]]:
    """``%(name)s`` parameters as ``$n`` (each name once), and the names in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(number, statement).encode(), tuple(names)


class PqCursor:
    """The few cursor calls RawSql makes, on a psycopg connection's libpq connection (in
    autocommit: each statement is its own transaction, as with psycopg's cursor)."""

    def __init__(self, connection: Connection[Any], answer_within_s: float,
                 prepare: bool = True) -> None:
        self.connection = connection
        self.prepare = prepare
        self.pgconn = connection.pgconn
        self.answer_within_s = answer_within_s
        self._poll: select.poll | None = None  # of the connection's socket, on first use
        self._tx = Transformer(connection)
        # (statement, parameter types) -> the name it is prepared under on this connection
        self._prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._rows: list[tuple[Any, ...]] = []

    def execute(self, statement: str, params: Mapping[str, Any] | None = None) -> PqCursor:
        query, names = positional(statement)
        given = params or {}
        tx = self._tx
        values = tx.dump_sequence([given[name] for name in names],
                                  [PyFormat.AUTO] * len(names))
        types = tx.types or ()
        pgconn = self.pgconn
        # libpq takes a NULL for a None (psycopg's own cursor passes them so)
        sent = cast(Sequence[bytes], values)
        result = None
        if self.prepare and _Preparing.on:
            result = self._run_prepared(query, types, sent)
        if result is None:
            result = self._answer(lambda: pgconn.send_query_params(
                query, sent, types, tx.formats))
        self._check(result)
        if result.status == pq.ExecStatus.TUPLES_OK:
            tx.set_pgresult(result)
            self._rows = tx.load_rows(0, result.ntuples, tuple)
        else:
            self._rows = []
        return self

    def _run_prepared(self, query: bytes, types: tuple[int, ...], values: Sequence[bytes],
                      ) -> pq.abc.PGresult | None:
        """The statement's result, prepared first if this connection has not yet; None if
        the server connection does not have it (a pooler in transaction mode): preparing
        is then off for the process, and the statement, which did not run, is the
        caller's to send unprepared."""
        pgconn, key = self.pgconn, (query, types)
        name = self._prepared.get(key)
        if name is None:
            name = statement_name(query, types)
            made = self._answer(lambda: pgconn.send_prepare(name, query, types))
            if made.error_field(pq.DiagnosticField.SQLSTATE) != ALREADY_PREPARED:
                self._check(made)
            self._prepared[key] = name
        result = self._answer(lambda: pgconn.send_query_prepared(
            name, values, self._tx.formats))
        if result.error_field(pq.DiagnosticField.SQLSTATE) != NOT_PREPARED_HERE:
            return result
        if _Preparing.on:
            _Preparing.on = False
            log.warning(
                "PostgreSQL answered that a statement this process prepared does not exist "
                "on the connection (SQLSTATE 26000): the store is behind a pooler in "
                "transaction mode. Statements are sent unprepared from now on; set "
                "LEASEKEEPER_STORE_PREPARED_STATEMENTS=false to skip this warning")
        return None

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows

    def close(self) -> None:
        self._rows = []

    def _answer(self, send: Callable[[], None]) -> pq.abc.PGresult:
        """Send a statement and wait for its result (the connection drained after it);
        OperationalError if no answer came within ``answer_within_s``."""
        pgconn = self.pgconn
        try:
            if self._poll is None:
                self._poll = select.poll()
                self._poll.register(pgconn.socket, select.POLLIN)
            send()
            deadline = time.monotonic() + self.answer_within_s
            while pgconn.is_busy():
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise OperationalError(
                        f"PostgreSQL did not answer within {self.answer_within_s:g} s "
                        "(store_statement_timeout_s and a grace for the server to cancel "
                        "first); the connection was dropped")
                self._poll.poll(left_s * 1000)  # a signal handler's exception ends it
                pgconn.consume_input()
            result = pgconn.get_result()
            while pgconn.get_result() is not None:  # (one statement: none; drain anyway)
                pass
        except BaseException:
            self.connection.close()  # the statement may still be in flight on it
            raise
        if result is None:
            raise OperationalError("PostgreSQL sent no result for the statement")
        return result

    def _check(self, result: pq.abc.PGresult) -> None:
        if result.status in _OK:
            return
        # libpq's message on one line (it folds some over several)
        message = " ".join((result.error_message or self.pgconn.error_message).decode(
            errors="replace").split())
        sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
        if sqlstate is None or self.pgconn.status != pq.ConnStatus.OK:
            raise OperationalError(message or "the connection to PostgreSQL failed")
        raise errors.lookup(sqlstate.decode())(message)
