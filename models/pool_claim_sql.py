"""The claim path's statements (models/pool_store.py runs them), built once per dialect:
building a statement costs about as much as running it on SQLite, and each round trip to
PostgreSQL counts in a claim's latency.

- take a member: ``UPDATE leases SET <the run's> WHERE lease_id = (SELECT lease_id ...
  WHERE pool = :pool AND state = 'warm' ORDER BY created_at, lease_id LIMIT 1 FOR UPDATE
  SKIP LOCKED) AND state = 'warm' RETURNING *``, its event (warm → provisioning) and the
  run's binding;
- activate it: ``UPDATE leases SET state = 'active' ... WHERE lease_id = :id AND run_id =
  :run AND state = 'provisioning' AND claimed_at IS NOT NULL`` and its event.

On PostgreSQL each is ONE statement (the event and the binding are data-modifying CTEs on
the guarded UPDATE, so they happen exactly when it matched): one round trip. On SQLite
(no DML in a WITH, no row locks: the transaction's write lock orders claims) they are two
or three statements in the same transaction, the later ones only when the UPDATE matched.
Every value is a bound parameter named ``b_*`` (see ``take_params``).
"""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import (
    JSON,
    Connection,
    DateTime,
    Row,
    Table,
    bindparam,
    insert,
    literal,
    select,
    update,
)

from models.schema import Lease, LeaseEvent, LeaseState, Run

L = cast(Table, Lease.__table__)
E = cast(Table, LeaseEvent.__table__)
R = cast(Table, Run.__table__)
_EVENT_COLUMNS = ["lease_id", "at", "from_state", "to_state", "reason", "task_id"]


def _now() -> Any:
    return bindparam("b_now", type_=DateTime())


@functools.cache
def _take_update(postgres: bool) -> Any:
    pick = (select(L.c.lease_id).where(L.c.pool == bindparam("b_pool"),
                                       L.c.state == LeaseState.WARM)
            .order_by(L.c.created_at, L.c.lease_id).limit(1))
    if postgres:
        pick = pick.with_for_update(skip_locked=True)
    return (update(L).where(L.c.lease_id == pick.scalar_subquery(),
                            L.c.state == LeaseState.WARM)
            .values(state=LeaseState.PROVISIONING, run_id=bindparam("b_run_id"),
                    tenant=bindparam("b_tenant"), thread_id=bindparam("b_thread_id"),
                    sandbox_key=bindparam("b_key"), live_key=bindparam("b_key"),
                    reuse=bindparam("b_reuse"), spec=bindparam("b_spec", type_=JSON),
                    claimed_at=_now(), updated_at=_now(),
                    acquire_deadline_at=bindparam("b_acquire_deadline_at", type_=DateTime()),
                    deadline_at=bindparam("b_deadline_at", type_=DateTime()),
                    idle_timeout_s=bindparam("b_idle_timeout_s"), version=L.c.version + 1)
            .returning(*L.c))


def _event_from(cte: Any, frm: LeaseState, to: LeaseState) -> Any:
    return insert(E).from_select(_EVENT_COLUMNS, select(
        cte.c.lease_id, _now(), literal(frm.value), literal(to.value),
        bindparam("b_reason"), bindparam("b_task_id")).select_from(cte))


@functools.cache
def _take_postgres() -> Any:
    taken = _take_update(True).cte("taken")
    event = _event_from(taken, LeaseState.WARM, LeaseState.PROVISIONING).cte("taken_event")
    bound = (update(R).where(R.c.run_id == taken.c.run_id)
             .values(lease_id=taken.c.lease_id, sandbox_key=taken.c.sandbox_key)
             .cte("bound_run"))
    return select(taken).add_cte(event, bound)


_EVENT = insert(E)
_BIND_RUN = (update(R).where(R.c.run_id == bindparam("b_run_id"))
             .values(lease_id=bindparam("b_lease_id"), sandbox_key=bindparam("b_key")))
_ACTIVATE = (update(L).where(L.c.lease_id == bindparam("b_lease_id"),
                            L.c.run_id == bindparam("b_run_id"),
                            L.c.state == LeaseState.PROVISIONING,
                            L.c.claimed_at.is_not(None))
             .values(state=LeaseState.ACTIVE, provider_meta=bindparam("b_meta", type_=JSON),
                     idle_deadline_at=bindparam("b_idle", type_=DateTime()),
                     updated_at=_now(), version=L.c.version + 1)
             .returning(L.c.lease_id))


@functools.cache
def _activate_postgres() -> Any:
    activated = _ACTIVATE.cte("activated")
    event = _event_from(activated, LeaseState.PROVISIONING, LeaseState.ACTIVE).cte(
        "activated_event")
    return select(activated.c.lease_id).add_cte(event)


def take(conn: Connection, postgres: bool, params: dict[str, Any]) -> Row[Any] | None:
    """The member taken for the run (its whole row, as it is now), or None."""
    if postgres:
        return conn.execute(_take_postgres(), params).one_or_none()
    row = conn.execute(_take_update(False), params).one_or_none()
    if row is not None:
        conn.execute(_EVENT, {"lease_id": row.lease_id, "at": params["b_now"],
                              "from_state": LeaseState.WARM,
                              "to_state": LeaseState.PROVISIONING,
                              "reason": params["b_reason"], "task_id": params["b_task_id"]})
        conn.execute(_BIND_RUN, {"b_run_id": params["b_run_id"], "b_lease_id": row.lease_id,
                                 "b_key": params["b_key"]})
    return row


def activate(conn: Connection, postgres: bool, params: dict[str, Any]) -> bool:
    """True if this call moved the claimed member to active."""
    if postgres:
        return conn.execute(_activate_postgres(), params).first() is not None
    won = conn.execute(_ACTIVATE, params).first() is not None
    if won:
        conn.execute(_EVENT, {"lease_id": params["b_lease_id"], "at": params["b_now"],
                              "from_state": LeaseState.PROVISIONING,
                              "to_state": LeaseState.ACTIVE, "reason": params["b_reason"],
                              "task_id": params["b_task_id"]})
    return won
