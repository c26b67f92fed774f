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
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

from psycopg import Connection, OperationalError, errors, pq
from psycopg.adapt import PyFormat, Transformer

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
# Prepared statements' names, unique in the process: a connection back in the pool keeps
# them, and a later cursor on it must not collide
_NAMES = itertools.count()


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

    def __init__(self, connection: Connection[Any]) -> None:
        self.pgconn = connection.pgconn
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
        key = (query, tx.types or ())
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = f"lk_hot_{next(_NAMES)}".encode()
            self._check(self.pgconn.prepare(prepared, query, key[1]))
            self._prepared[key] = prepared
        # libpq takes a NULL for a None (psycopg's own cursor passes them so)
        result = self.pgconn.exec_prepared(prepared, cast(Sequence[bytes], values), tx.formats)
        self._check(result)
        if result.status == pq.ExecStatus.TUPLES_OK:
            tx.set_pgresult(result)
            self._rows = tx.load_rows(0, result.ntuples, tuple)
        else:
            self._rows = []
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows

    def close(self) -> None:
        self._rows = []

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
