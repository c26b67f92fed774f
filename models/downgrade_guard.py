"""What a downgrade would strand: live leases that only a migration it undoes lets the
code see, so the release before it would never drain or destroy them (their sandboxes would
run for ever, and `leasekeeper check` would flag them once upgraded again).

Per migration whose downgrade drops such a state or column:

- ``0005_pools13`` (warm pools: the ``warm`` state, ``leases.pool``): unclaimed pool members
  still provisioning or warm. Members being drained (pending_cleanup, destroying) and claimed
  ones (a run bound) are ordinary leases to the release before: they are not counted.
- ``0001`` (the whole schema): every lease not destroyed; the leases table is the only record
  of their sandboxes.

The other migrations add indexes, or columns whose loss strands nothing (``prev_state``:
the next change's event names no state left; ``secret_env_given``: the lease's spec
decides again). ``models/migrate.py`` asks before undoing anything; the two migrations
ask again themselves (alembic run by hand).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, text

from providers.errors import LeasekeeperError

POOLS = "0005_pools13"
BASE_SCHEMA = "0001"

_AGAIN = ("then stop every leasekeeper process on this store and run the downgrade again")


class WouldStrand(LeasekeeperError):
    """A downgrade refused before it changed anything: it would strand live leases."""


@dataclass(frozen=True)
class Stranded:
    revision: str  # the migration whose downgrade would strand them
    by_state: dict[str, int]  # how many, by state
    pools: tuple[str, ...]  # the pools they belong to (0005 only)

    def describe(self) -> str:
        counts = ", ".join(f"{n} {state}" for state, n in self.by_state.items())
        total = sum(self.by_state.values())
        if self.revision == POOLS:
            return (
                f"{total} lease(s) ({counts}) are unclaimed members of warm pool(s) "
                f"{', '.join(self.pools)}; undoing {POOLS} drops their pool and the warm "
                "state, and nothing would then drain or destroy them: their sandboxes would "
                "run for ever. First empty the pools: remove them from LEASEKEEPER_POOLS (or "
                "LEASEKEEPER_POOLS_FILE) and restart the workers and beat, which drain the "
                "members (or stop beat and run `leasekeeper leases destroy --state warm "
                "--yes`); wait until `leasekeeper pools` counts no member warm or "
                f"provisioning, {_AGAIN}")
        return (
            f"{total} lease(s) ({counts}) are not destroyed; undoing {BASE_SCHEMA} drops the "
            "leases table, the only record of their sandboxes, which would run for ever. "
            "First destroy them (`leasekeeper leases destroy --state active --yes`, and "
            "likewise each other state listed; an abandoned one: remove its sandbox by hand, "
            "then `leasekeeper leases forget <id>`); wait until `leasekeeper leases list` "
            f"shows every lease destroyed, {_AGAIN}")


def _pool_members(conn: Connection) -> Stranded | None:
    rows = conn.execute(text(
        "SELECT state, pool, COUNT(*) FROM leases WHERE pool IS NOT NULL AND run_id IS NULL "
        "AND state IN ('warm', 'provisioning') GROUP BY state, pool")).all()
    if not rows:
        return None
    by_state: dict[str, int] = {}
    for state, _pool, n in rows:
        by_state[state] = by_state.get(state, 0) + int(n)
    return Stranded(POOLS, dict(sorted(by_state.items(), key=lambda kv: kv[0] != "warm")),
                    tuple(sorted({str(pool) for _state, pool, _n in rows})))


def _undestroyed(conn: Connection) -> Stranded | None:
    rows = conn.execute(text(
        "SELECT state, COUNT(*) FROM leases WHERE state <> 'destroyed' GROUP BY state "
        "ORDER BY state")).all()
    return Stranded(BASE_SCHEMA, {str(s): int(n) for s, n in rows}, ()) if rows else None


CHECKS = {POOLS: _pool_members, BASE_SCHEMA: _undestroyed}


def stranded(conn: Connection, undone: Iterable[str]) -> list[Stranded]:
    """What undoing the migrations ``undone`` (newest first) would strand, migration by
    migration, newest first (empty: nothing)."""
    each = [CHECKS[revision](conn) for revision in undone if revision in CHECKS]
    found = [x for x in each if x is not None]
    # the whole schema going counts every lease the others would: say it once
    return [x for x in found if x.revision == BASE_SCHEMA] or found


def refusal(found: list[Stranded]) -> WouldStrand:
    return WouldStrand("not undone, nothing was changed: " + "; and ".join(
        x.describe() for x in found))


def refuse_stranding(conn: Connection, revision: str) -> None:
    """For a migration's own downgrade: refuse if undoing it strands live leases."""
    found = stranded(conn, [revision])
    if found:
        raise refusal(found)
