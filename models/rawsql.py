"""The store's hot path in plain SQL on the DBAPI connection: a lease state change (with
its event and its runs' settlement) and a new run's lease intent.

Every lifecycle task pays for these statements, and SQLAlchemy's statement building,
cache keys and ORM units of work cost about ten times what the database does for them
(bench/throughput.py), so they are SQL text, written once per dialect and cached:

- SQLite (in-process, no round trips): a few short statements in one ``BEGIN IMMEDIATE``
  transaction, which holds the write lock, so what they read cannot change under them.
- PostgreSQL (every statement is a round trip): ONE statement per state change, sent in
  autocommit, so a change, its event and its runs' settlement cost one round trip. The
  guarded ``UPDATE ... WHERE state = ANY(:expected)`` is the lock: a concurrent change
  makes it wait, then re-check its WHERE on the newest row version, so two workers never
  both move a lease. Data-modifying CTEs see each other's ``RETURNING`` rows, never each
  other's writes, which is why each CTE reads ``moved`` rather than the table.

Either way a change sets ``prev_state = state`` in its SET, which reads the row being
replaced, so the event names the state really left without a read first; a change that
moves nothing costs one more read, to tell "not in an expected state" from "no such
lease".

The same functions run inside a SQLAlchemy session's transaction (the sweeps), on the
session's own DBAPI connection, so there is one implementation of a state change.
Statements use ``:name`` parameters; for psycopg they are rewritten to ``%(name)s``.
They are built only from this module's text, the tables' column names and our own enum
values; every value from outside is a bound parameter (hence the S608 waiver below).
"""
# ruff: noqa: S608

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from models.schema import (
    FINAL_STATES,
    LIVE_STATES,
    ClaimedLease,
    LeaseRecord,
    LeaseState,
    ReclaimOutcome,
    RunStatus,
)
from providers.errors import NotFound

LEASE_COLUMNS = tuple(f.name for f in fields(LeaseRecord))
_TIME_COLUMNS = frozenset({"created_at", "updated_at", "ready_at", "acquire_deadline_at",
                           "deadline_at", "idle_deadline_at", "next_cleanup_at",
                           "claimed_at"})
_JSON_COLUMNS = frozenset({"provider_meta", "spec"})
# Positions in a leases row selected as LEASE_COLUMNS (SQLite stores these as text)
_TIME_AT = tuple(i for i, c in enumerate(LEASE_COLUMNS) if c in _TIME_COLUMNS)
_JSON_AT = tuple(i for i, c in enumerate(LEASE_COLUMNS) if c in _JSON_COLUMNS)
# What a destroy's claim reads back (ClaimedLease's fields, in order)
CLAIM_COLUMNS = tuple(f.name for f in fields(ClaimedLease))
_CLAIM_JSON_AT = tuple(i for i, c in enumerate(CLAIM_COLUMNS) if c in _JSON_COLUMNS)
_REUSE_AT = LEASE_COLUMNS.index("reuse")
# Columns a transition may set besides the ones it always sets.
SETTABLE = frozenset(LEASE_COLUMNS) - {"lease_id", "state", "updated_at", "version",
                                       "live_key", "created_at"}
UNFINISHED = (RunStatus.RUNNING, RunStatus.INTERRUPTED)
_PARAM = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def _quoted(values: Iterable[str]) -> str:
    """Our own enum values as SQL literals (never input: they are matched against enums)."""
    return ", ".join(f"'{v}'" for v in sorted(values))


def _flip(frm: str | None, to: str) -> tuple[ReclaimOutcome, ReclaimOutcome] | None:
    """The reclaim outcome a state change corrects: a destroy that finally took turns
    ``destroy-failed`` into ``destroyed``; a destroyed lease going back to cleanup (its
    resource was still there) turns ``destroyed`` into ``destroy-failed``."""
    if to == LeaseState.DESTROYED:
        return ReclaimOutcome.DESTROY_FAILED, ReclaimOutcome.DESTROYED
    if frm == LeaseState.DESTROYED:
        return ReclaimOutcome.DESTROYED, ReclaimOutcome.DESTROY_FAILED
    return None


def _note(flipped: Iterable[str], flip: tuple[ReclaimOutcome, ReclaimOutcome] | None) -> str:
    if flip is None:
        return ""
    return "; ".join(f"reclaim of run {run_id}: {flip[0]} → {flip[1]}" for run_id in flipped)


@dataclass(frozen=True)
class Change:
    """One guarded state change, as the callers ask for it."""

    lease_id: str
    expected: frozenset[str]
    to: LeaseState
    reason: str
    task_id: str | None
    values: Mapping[str, Any]
    # end_reason only if the lease has none yet (the first reason a lease ended wins)
    first_end_reason: str | None = None
    # an extra guard, SQL over the leases row (alias-free column names), and its params
    guard: str = ""
    guard_params: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.values.keys() <= SETTABLE:
            raise ValueError(f"a transition cannot set {sorted(set(self.values) - SETTABLE)}")
        if not self.expected:
            raise ValueError("a transition needs at least one expected state")


class SessionCursor:
    """The few cursor calls RawSql makes, on a SQLAlchemy Connection (a session's): its
    statements run in that transaction through ``exec_driver_sql``, so SQLAlchemy's
    events, error translation and savepoints see them as any other statement."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.result = conn, None

    def execute(self, statement: str, params: Mapping[str, Any] | None = None
                ) -> SessionCursor:
        self.result = self.conn.exec_driver_sql(statement, dict(params or {}))
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        row = self.result.fetchone() if self.result is not None else None
        return None if row is None else tuple(row)

    def fetchall(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.result.fetchall()] if self.result is not None else []


class RawSql:
    """The hot statements of one dialect, their parameters and their rows."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("sqlite", "postgresql"):
            raise ValueError(f"no plain-SQL path for dialect {dialect!r}")
        self.dialect = dialect
        self.pg = dialect == "postgresql"
        if self.pg:
            from psycopg.types.json import Json

            self._json: Any = Json
        self.sql = functools.lru_cache(maxsize=256)(self._sql)

    # -- values ------------------------------------------------------------------------
    def _sql(self, text: str) -> str:
        return _PARAM.sub(r"%(\1)s", text) if self.pg else text

    def time(self, moment: datetime | None) -> Any:
        """A naive UTC datetime as the column stores it (SQLite: SQLAlchemy's text,
        ``YYYY-MM-DD HH:MM:SS.ffffff``, microseconds always written, so text order is
        time order)."""
        if moment is None or self.pg:
            return moment
        if moment.tzinfo is not None:
            moment = moment.replace(tzinfo=None)
        return moment.isoformat(" ", "microseconds")

    def json(self, value: Any) -> Any:
        return self._json(value) if self.pg else json.dumps(value)

    def param(self, column: str, value: Any) -> Any:
        if column in _TIME_COLUMNS:
            return self.time(value)
        if column in _JSON_COLUMNS:
            return self.json(value)
        return value

    def lease(self, row: tuple[Any, ...]) -> LeaseRecord:
        """A leases row, selected as LEASE_COLUMNS, as a LeaseRecord."""
        if self.pg:
            return LeaseRecord(*row)
        values = list(row)
        parse_time = datetime.fromisoformat
        for at in _TIME_AT:
            raw = values[at]
            if raw is not None:
                values[at] = parse_time(raw)
        for at in _JSON_AT:
            values[at] = _json_value(values[at])
        values[_REUSE_AT] = bool(values[_REUSE_AT])
        return LeaseRecord(*values)

    # -- a state change ----------------------------------------------------------------
    def transition(self, cur: Any, change: Change, now: datetime) -> LeaseRecord | None:
        """Apply ``change`` on ``cur`` (inside the caller's transaction, or alone in
        autocommit on PostgreSQL); the new row, None if the lease is not in an expected
        state (or fails the guard), NotFound if there is no such lease."""
        row = self._apply(cur, change, now, LEASE_COLUMNS)
        if row is None:
            return None
        return LeaseRecord(*row) if self.pg else self.lease(row)

    def move(self, cur: Any, change: Change, now: datetime) -> bool:
        """:meth:`transition` for a caller that needs no row back: whether it moved (a
        row converted costs more than the rest of the change's Python)."""
        return self._apply(cur, change, now, MOVED_COLUMNS) is not None

    def claim(self, cur: Any, change: Change, now: datetime) -> ClaimedLease | None:
        """:meth:`transition` for a destroy's claim: only the columns it reads."""
        row = self._apply(cur, change, now, CLAIM_COLUMNS)
        if row is None:
            return None
        if self.pg:
            return ClaimedLease(*row)
        values = list(row)
        for at in _CLAIM_JSON_AT:
            values[at] = _json_value(values[at])
        return ClaimedLease(*values)

    def _apply(self, cur: Any, change: Change, now: datetime, returning: tuple[str, ...]
               ) -> tuple[Any, ...] | None:
        """The change; the row it returns: the ``returning`` columns (LEASE_COLUMNS,
        MOVED_COLUMNS or CLAIM_COLUMNS), in that order."""
        to = str(change.to)
        params: dict[str, Any] = {
            "lease_id": change.lease_id, "to": to, "now": self.time(now),
            "first_end_reason": change.first_end_reason, "task_id": change.task_id,
        }
        for column, value in change.values.items():
            params["v_" + column] = self.param(column, value)
        if change.guard_params:
            params.update(change.guard_params)
        statement = _statement(self.pg, change.expected, change.to, tuple(change.values),
                               change.first_end_reason is not None, change.guard, returning)
        if self.pg:
            params["reason"] = change.reason[:2000]
            cur.execute(statement, params)
            row: tuple[Any, ...] | None = cur.fetchone()
            if row is None:
                self._missed(cur, change, params)
            return row
        row = cur.execute(statement, params).fetchone()
        if row is None:
            self._missed(cur, change, params)
            return None
        prev_state_at, end_reason_at = _moved_at(returning)
        frm = params["frm"] = row[prev_state_at]
        if to in FINAL_STATES:
            end_reason = row[end_reason_at]
            params["error"] = f"its lease {change.lease_id} ended: {end_reason or to}"
            cur.execute(_SQLITE_ABORT_RUNS, params)
        flip = _flip(frm, to)
        note = ""
        if flip is not None:
            params["was"], params["becomes"] = flip
            note = _note((r[0] for r in cur.execute(_SQLITE_FLIP_RUNS, params).fetchall()),
                         flip)
        params["reason"] = (f"{change.reason} ({note})" if note else change.reason)[:2000]
        cur.execute(_INSERT_EVENT, params)
        return tuple(row)

    def _missed(self, cur: Any, change: Change, params: dict[str, Any]) -> None:
        """A change that moved nothing: the lease is not in an expected state (another
        worker won, or the guard failed): None; or there is no such lease: NotFound."""
        if cur.execute(self.sql("SELECT 1 FROM leases WHERE lease_id = :lease_id"),
                       params).fetchone() is None:
            raise NotFound(f"no lease {change.lease_id!r} in the store")

    # -- runs ---------------------------------------------------------------------------
    def insert_run(self, cur: Any, run_id: str, thread_id: str | None, provider: str,
                   sandbox_key: str, now: datetime, secret_env_given: bool
                   ) -> tuple[Any, ...] | None:
        """Insert a new run, with no lease yet, unless it exists; a row (its id) if this
        call inserted it."""
        cur.execute(self.sql(_NEW_RUN), {
            "run_id": run_id, "thread_id": thread_id, "provider": provider,
            "sandbox_key": sandbox_key, "lease_id": None, "now": self.time(now),
            "secret_env_given": secret_env_given})
        row: tuple[Any, ...] | None = cur.fetchone()
        return row

    # -- a new run and its lease intent ------------------------------------------------
    def start_run_with_intent(self, cur: Any, intent: Mapping[str, Any], reason: str,
                              task_id: str | None, now: datetime) -> bool:
        """Insert a new run, bound to a new lease intent, and the intent's event, in the
        caller's transaction (one statement on PostgreSQL). ``intent`` has what differs
        between intents (run_id, lease_id, thread_id, provider, sandbox_key,
        provider_lease_id, reuse, tenant, spec, acquire_deadline_at, deadline_at,
        idle_timeout_s, pool, secret_env_given); the rest (a new run's and a new
        intent's constants, and ``now`` for every time it records) is in the statement.
        False, and nothing written, if the run already exists; a live lease on the key
        raises the driver's IntegrityError (the caller rolls back)."""
        params = dict(intent)
        params["spec"] = self.json(intent["spec"])
        params["acquire_deadline_at"] = self.time(intent["acquire_deadline_at"])
        params["deadline_at"] = self.time(intent["deadline_at"])
        params["now"], params["reason"], params["task_id"] = (
            self.time(now), reason[:2000], task_id)
        if self.pg:
            cur.execute(_PG_START_WITH_INTENT, params)
            return bool(cur.fetchone()[0])
        if cur.execute(_NEW_RUN, params).fetchone() is None:
            return False
        cur.execute(_INSERT_INTENT, params)
        params["frm"], params["to"] = None, LeaseState.PROVISIONING.value
        cur.execute(_INSERT_EVENT, params)
        return True

    # -- a warm pool member taken by a run ---------------------------------------------
    def claim_member(self, cur: Any, claim: Mapping[str, Any], reason: str,
                     task_id: str | None, now: datetime) -> LeaseRecord | None:
        """The oldest warm member of ``claim["pool"]`` made the run's (provisioning, claimed
        now, the run's key, tenant, spec and deadlines), its event and the run's binding,
        in the caller's transaction (one statement on PostgreSQL, where a member another
        claim holds is skipped, never waited for). None if the pool has no warm member; a
        live lease on the run's key raises the driver's IntegrityError."""
        params: dict[str, Any] = {
            **{f"c_{k}": self.param(k, v) for k, v in claim.items()},
            "now": self.time(now), "reason": reason[:2000], "task_id": task_id,
            "frm": LeaseState.WARM.value, "to": LeaseState.PROVISIONING.value}
        if self.pg:
            cur.execute(self.sql(_PG_CLAIM_MEMBER), params)
            row = cur.fetchone()
            return None if row is None else LeaseRecord(*row)
        row = cur.execute(_SQLITE_CLAIM_MEMBER, params).fetchone()
        if row is None:
            return None
        lease = self.lease(row)
        params["lease_id"] = lease.lease_id
        cur.execute(_INSERT_EVENT, params)
        cur.execute("UPDATE runs SET lease_id = :lease_id, sandbox_key = :c_sandbox_key "
                    "WHERE run_id = :c_run_id", params)
        return lease


def _flips_possible(expected: frozenset[str], to: str) -> bool:
    return to == LeaseState.DESTROYED or LeaseState.DESTROYED in expected


_RETURNING = ", ".join(LEASE_COLUMNS)
# What a change that returns no row still reads of the row it moved: the state it left
# (its event) and its end reason (its runs' settlement). Every shape returns them.
MOVED_COLUMNS = ("prev_state", "end_reason")


def _json_value(raw: str | None) -> Any:
    """A JSON column's value as SQLite returns it (text)."""
    return {} if raw is None or raw == "{}" else json.loads(raw)


@functools.lru_cache(maxsize=8)
def _moved_at(returning: tuple[str, ...]) -> tuple[int, int]:
    """Where MOVED_COLUMNS are in a row of ``returning``."""
    return returning.index("prev_state"), returning.index("end_reason")


_INSERT_EVENT = ("INSERT INTO lease_events (lease_id, at, from_state, to_state, reason, "
                 "task_id) VALUES (:lease_id, :now, :frm, :to, :reason, :task_id)")
_SQLITE_ABORT_RUNS = (
    "UPDATE runs SET status = 'aborted', finished_at = :now, reclaim_due = 0, "
    "reclaim_claimed_until = NULL, error = :error "
    f"WHERE lease_id = :lease_id AND status IN ({_quoted(UNFINISHED)})")
_SQLITE_FLIP_RUNS = ("UPDATE runs SET reclaim_outcome = :becomes, reclaimed_at = :now "
                     "WHERE lease_id = :lease_id AND reclaim_outcome = :was RETURNING run_id")


@functools.lru_cache(maxsize=256)
def _statement(pg: bool, expected: frozenset[str], to: LeaseState, columns: tuple[str, ...],
               first_end_reason: bool, guard: str, returning: tuple[str, ...]) -> str:
    """The statement of every change of one shape (the states it moves between, the
    columns it sets, its guard, the row it returns), built once: only values differ."""
    if not set(MOVED_COLUMNS) <= set(returning):
        raise ValueError(f"a change must return {MOVED_COLUMNS}, not only {returning}")
    sets = _set_clause(expected, to, columns, first_end_reason)
    where = f"state IN ({_quoted(expected)})" + (f" AND ({guard})" if guard else "")
    if not pg:
        return (f"UPDATE leases SET {sets} WHERE lease_id = :lease_id AND {where} "
                f"RETURNING {', '.join(returning)}")
    return _PARAM.sub(r"%(\1)s", _pg_transition(sets, where, to in FINAL_STATES,
                                                _flips_possible(expected, to), returning))


def _set_clause(expected: frozenset[str], to: LeaseState, columns: tuple[str, ...],
                first_end_reason: bool) -> str:
    """SET of a change: ``prev_state`` from the row being replaced (SET reads the old
    row on both databases), and ``live_key`` only when liveness can change (on SQLite
    an UPDATE maintains only the indexes of the columns it sets)."""
    live_to = to in LIVE_STATES
    sets = ["prev_state = state", "state = :to", "updated_at = :now", "version = version + 1"]
    if "sandbox_key" in columns or any((state in LIVE_STATES) != live_to for state in expected):
        sets.append(f"live_key = {'sandbox_key' if live_to else 'NULL'}")
    sets += [f"{k} = :v_{k}" for k in sorted(columns)]
    if first_end_reason and "end_reason" not in columns:
        sets.append("end_reason = COALESCE(end_reason, :first_end_reason)")
    return ", ".join(sets)


def _pg_transition(sets: str, where: str, final: bool, flips: bool,
                   returning: tuple[str, ...]) -> str:
    """One statement: move the row if its state is expected (and the guard holds; an
    UPDATE's WHERE is evaluated again on the newest row version if another transaction
    changed it meanwhile), settle its runs, append the event naming ``prev_state``, the
    state the UPDATE replaced; the ``returning`` columns of the new row, or no row if
    nothing moved."""
    # the CTEs below read the moved row's id, the state it left and its end reason
    read = ", ".join(dict.fromkeys(("lease_id", *MOVED_COLUMNS, *returning)))
    ctes = [
        f"moved AS (UPDATE leases SET {sets} WHERE lease_id = :lease_id AND {where} "
        f"RETURNING {read})",
    ]
    note = "''"
    if final:
        ctes.append(
            "aborted AS (UPDATE runs AS r SET status = 'aborted', finished_at = :now, "
            "reclaim_due = false, reclaim_claimed_until = NULL, error = 'its lease ' || "
            "m.lease_id || ' ended: ' || COALESCE(m.end_reason, :to) FROM moved AS m "
            f"WHERE r.lease_id = m.lease_id AND r.status IN ({_quoted(UNFINISHED)}) "
            "RETURNING r.run_id)")
    if flips:
        # destroyed: destroy-failed -> destroyed; from destroyed: destroyed -> destroy-failed
        was = (f"CASE WHEN :to = '{LeaseState.DESTROYED}' "
               f"THEN '{ReclaimOutcome.DESTROY_FAILED}' "
               f"WHEN m.prev_state = '{LeaseState.DESTROYED}' "
               f"THEN '{ReclaimOutcome.DESTROYED}' END")
        becomes = (f"CASE WHEN :to = '{LeaseState.DESTROYED}' THEN "
                   f"'{ReclaimOutcome.DESTROYED}' ELSE '{ReclaimOutcome.DESTROY_FAILED}' END")
        ctes.append(
            f"flipped AS (UPDATE runs AS r SET reclaim_outcome = {becomes}, "
            "reclaimed_at = :now FROM moved AS m WHERE r.lease_id = m.lease_id "
            f"AND r.reclaim_outcome = {was} RETURNING r.run_id, {was} AS was, "
            f"{becomes} AS becomes)")
        note = ("COALESCE((SELECT ' (' || string_agg('reclaim of run ' || f.run_id || ': ' "
                "|| f.was || ' → ' || f.becomes, '; ' ORDER BY f.run_id) || ')' "
                "FROM flipped AS f), '')")
    ctes.append(
        "ev AS (INSERT INTO lease_events (lease_id, at, from_state, to_state, reason, "
        f"task_id) SELECT m.lease_id, :now, m.prev_state, :to, left(:reason || {note}, 2000), "
        ":task_id FROM moved AS m)")
    return "WITH " + ", ".join(ctes) + f" SELECT {', '.join(returning)} FROM moved"


# A new run (running, nothing requested or due yet; whether its acquire carried
# secret_env) and its lease intent (provisioning, live on its key, no provider meta yet,
# version 1), both recorded ``now``.
_NEW_RUN = (
    "INSERT INTO runs (run_id, thread_id, status, provider, sandbox_key, lease_id, "
    "started_at, cancel_requested, reclaim_due, secret_env_given) VALUES (:run_id, "
    f":thread_id, '{RunStatus.RUNNING}', :provider, :sandbox_key, :lease_id, :now, false, "
    "false, :secret_env_given) ON CONFLICT (run_id) DO NOTHING RETURNING run_id")
_INTENT_COLUMNS = (
    "lease_id, sandbox_key, live_key, provider, provider_lease_id, provider_meta, state, "
    "reuse, tenant, thread_id, run_id, spec, created_at, updated_at, acquire_deadline_at, "
    "deadline_at, idle_timeout_s, cleanup_attempts, version, pool")
_INTENT_VALUES = (
    ":lease_id, :sandbox_key, :sandbox_key, :provider, :provider_lease_id, '{}', "
    f"'{LeaseState.PROVISIONING}', :reuse, :tenant, :thread_id, :run_id, :spec, :now, :now, "
    ":acquire_deadline_at, :deadline_at, :idle_timeout_s, 0, 1, :pool")
_INSERT_INTENT = f"INSERT INTO leases ({_INTENT_COLUMNS}) VALUES ({_INTENT_VALUES})"
_PG_START_WITH_INTENT = _PARAM.sub(r"%(\1)s", (
    f"WITH run AS ({_NEW_RUN}), "
    f"lease AS (INSERT INTO leases ({_INTENT_COLUMNS}) SELECT {_INTENT_VALUES} FROM run "
    "RETURNING lease_id), "
    "ev AS (INSERT INTO lease_events (lease_id, at, from_state, to_state, reason, "
    f"task_id) SELECT lease_id, :now, NULL, '{LeaseState.PROVISIONING}', :reason, "
    ":task_id FROM lease) SELECT count(*) FROM run"))


# A claim takes the pool's oldest warm member (partial index ix_leases_warm_pool_created).
_CLAIM_SET = (
    f"prev_state = state, state = '{LeaseState.PROVISIONING}', run_id = :c_run_id, "
    "tenant = :c_tenant, "
    "thread_id = :c_thread_id, sandbox_key = :c_sandbox_key, live_key = :c_sandbox_key, "
    "reuse = :c_reuse, spec = :c_spec, claimed_at = :now, updated_at = :now, "
    "acquire_deadline_at = :c_acquire_deadline_at, deadline_at = :c_deadline_at, "
    "idle_timeout_s = :c_idle_timeout_s, version = version + 1")


def _oldest_warm(runs: str) -> str:
    """The pool's oldest warm member, none if the run (its row in ``runs``) has ended, or
    was bound to a lease since the acquire read it (``:c_bound_lease``, the lease it had
    then: another copy of the acquire bound it first): a member is claimed only for a
    run still running and unbound, or with no row. PostgreSQL passes its locked copy of
    the run's row (a twin's claim waits for this one's, then sees its binding), so a
    run.finish waits for the claim and its reclaim then finds the member bound; on SQLite
    the claim's transaction holds the write lock."""
    return (f"SELECT lease_id FROM leases WHERE pool = :c_pool "
            f"AND state = '{LeaseState.WARM}' AND NOT EXISTS (SELECT 1 FROM {runs} AS r "
            f"WHERE r.run_id = :c_run_id AND (r.status <> '{RunStatus.RUNNING}' OR "
            "r.lease_id <> COALESCE(:c_bound_lease, ''))) "
            "ORDER BY created_at, lease_id LIMIT 1")


_SQLITE_CLAIM_MEMBER = (
    f"UPDATE leases SET {_CLAIM_SET} WHERE lease_id = ({_oldest_warm('runs')}) "
    f"AND state = '{LeaseState.WARM}' RETURNING {_RETURNING}")
_PG_CLAIM_MEMBER = (
    "WITH run AS (SELECT run_id, status, lease_id FROM runs WHERE run_id = :c_run_id "
    "FOR UPDATE), "
    f"pick AS ({_oldest_warm('run')} FOR UPDATE SKIP LOCKED), "
    f"taken AS (UPDATE leases AS l SET {_CLAIM_SET} FROM pick "
    f"WHERE l.lease_id = pick.lease_id AND l.state = '{LeaseState.WARM}' "
    "RETURNING " + ", ".join(f"l.{c}" for c in LEASE_COLUMNS) + "), "
    "ev AS (INSERT INTO lease_events (lease_id, at, from_state, to_state, reason, task_id) "
    "SELECT lease_id, :now, :frm, :to, :reason, :task_id FROM taken), "
    "bound AS (UPDATE runs AS r SET lease_id = t.lease_id, sandbox_key = t.sandbox_key "
    "FROM taken AS t WHERE r.run_id = :c_run_id) "
    f"SELECT {_RETURNING} FROM taken")
