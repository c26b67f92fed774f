"""Warm pools in the store: member intents, the claim, the circuit breaker, the drain.

A pool *member* is a lease with ``pool`` set and no run (``run_id`` NULL) until a run
claims it. Every method is one short transaction, and every lease change a guarded move
with its event (models/sweep_store.py ``move``), as everywhere in the store:

- :meth:`PoolStore.fill` locks the pool's row in ``pools`` (``SELECT ... FOR UPDATE`` on
  PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises writers), counts the members
  that exist (provisioning, warm, and those draining: pending_cleanup or destroying) and
  inserts member intents (provisioning, with the provider name each will use) up to
  ``size`` live members and never beyond ``max_size`` existing ones, at most a batch. So
  ``max_size`` holds at every instant with any number of fillers. It creates nothing while
  the pool's circuit breaker is open, and one probe at a time while it is half open.
- :meth:`PoolStore.claim` takes the oldest warm member in ONE guarded statement:
  ``UPDATE leases SET ... WHERE lease_id = (SELECT ... WHERE pool = :p AND state = 'warm'
  ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED) AND state = 'warm' RETURNING ...``
  (no row locks on SQLite), and binds the run, in one transaction: two claims never get
  the same member, and a claim never waits for another (models/rawsql.py).
- :meth:`PoolStore.member_ready` / :meth:`member_failed` end a member's provisioning and
  close or count the breaker in the same transaction.
- :meth:`PoolStore.due_drains` / :meth:`claim_drains`: warm members past ``max_age_s``,
  beyond a shrunk pool's size, of a removed pool, or made from an older template.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import ColumnElement, Table, and_, func, insert, not_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from models.schema import Lease, LeaseEvent, LeaseRecord, LeaseState, Pool, Run, RunStatus, utcnow
from models.store import LiveLeaseExists, RunRebound, Store
from models.sweep_store import move
from providers.errors import InvalidRequest

# the guard of a move that only an unclaimed pool member may make (models/rawsql.py)
UNCLAIMED = "run_id IS NULL"
L = cast(Table, Lease.__table__)
E = cast(Table, LeaseEvent.__table__)
R = cast(Table, Run.__table__)
P = cast(Table, Pool.__table__)

# Unclaimed members that exist (a sandbox may be there): what max_size bounds.
MEMBER_STATES = (LeaseState.PROVISIONING, LeaseState.WARM, LeaseState.PENDING_CLEANUP,
                 LeaseState.DESTROYING)
LAST_ERROR_CHARS = 500
# How a warm member's exit is recorded as its pool's last error (member_ready reads it)
WARM_EXIT = "a warm member's command exited"
# How a provider's refusal of the pool's template (its check_spec) is recorded as the
# pool's last error (Breaker.refused, PoolStore.fill and `leasekeeper status` read it)
TEMPLATE_REFUSED = "template refused"


def unclaimed(pool: str) -> list[ColumnElement[bool]]:
    return [L.c.pool == pool, L.c.run_id.is_(None)]


class BreakerState(StrEnum):
    CLOSED = "closed"  # creating members
    OPEN = "open"  # too many consecutive failures: creating nothing until open_until
    HALF_OPEN = "half_open"  # the backoff passed: one probe member at a time


@dataclass(frozen=True)
class BreakerPolicy:
    threshold: int  # consecutive failures that open the breaker
    backoff_s: float  # first open period; doubles with each further failure
    backoff_max_s: float

    def backoff(self, failures: int) -> float:
        return float(min(self.backoff_s * 2 ** max(failures - self.threshold, 0),
                         self.backoff_max_s))


@dataclass(frozen=True)
class Breaker:
    name: str
    consecutive_failures: int = 0
    failures_total: int = 0
    open_until: datetime | None = None
    last_error: str | None = None

    @property
    def refused(self) -> bool:
        """Its latest failure is the provider refusing the pool's template, and no member
        became ready since: the pool cannot create anything until its template changes."""
        return self.consecutive_failures > 0 and (self.last_error or "").startswith(
            TEMPLATE_REFUSED)

    def state(self, threshold: int, now: datetime) -> BreakerState:
        if self.consecutive_failures < threshold:
            return BreakerState.CLOSED
        if self.open_until is not None and self.open_until > now:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN


@dataclass(frozen=True)
class FillTarget:
    """What one pool's fill needs: its bounds and what its member intents look like."""

    pool: str
    size: int
    max_size: int
    batch: int
    provider: str
    tenant: str
    spec: dict[str, Any]  # the member spec, redacted (a template holds no secrets anyway)
    max_age_s: float
    acquire_timeout_s: float
    idle_timeout_s: int
    name_for: Callable[[str], str]  # lease id -> provider resource name
    new_id: Callable[[], str]
    # the provider's refusal of the template (its check_spec), as the pool's last error
    # records it (TEMPLATE_REFUSED: ...): where members would be created, a failure instead
    refused: str | None = None


class FillDecision(StrEnum):
    CREATED = "created"  # member intents inserted
    FULL = "full"  # size live members already
    AT_MAX_SIZE = "at_max_size"  # below size, but max_size members exist (drains pending)
    BREAKER_OPEN = "breaker_open"  # creating nothing until the backoff passes
    PROBING = "probing"  # half open: a probe member is (now) being created
    REFUSED = "refused"  # members were due, but the provider refuses the template: a failure


@dataclass(frozen=True)
class Filled:
    decision: FillDecision
    lease_ids: list[str]  # the member intents recorded (none in a dry run)
    counts: dict[str, int]  # unclaimed members by state, before this fill
    breaker: Breaker
    room: int = 0  # members created (or, in a dry run, that would be)


@dataclass(frozen=True)
class ClaimIntent:
    """The run's side of a claim: what the member becomes."""

    pool: str
    run_id: str
    sandbox_key: str
    tenant: str
    thread_id: str | None
    reuse: bool
    spec: dict[str, Any]  # redacted: the template merged with the run's spec
    acquire_deadline_at: datetime
    deadline_at: datetime
    idle_timeout_s: int
    bound_lease: str | None = None  # the run's lease when the acquire read it (ended)


class DrainKind(StrEnum):
    EXPIRED = "expired"  # warm past the pool's max_age_s
    EXCESS = "excess"  # more live members than the pool's size (it shrank)
    REMOVED = "removed"  # its pool is no longer declared
    STALE = "stale"  # made from another template than the pool's current one


@dataclass(frozen=True)
class DrainRule:
    """What a declared pool keeps: ``size`` live members made from ``spec``."""

    size: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class Drain:
    lease_id: str
    pool: str
    kind: DrainKind


class PoolStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._postgres = store.engine.dialect.name == "postgresql"

    # -- the pool row: the fillers' lock and the breaker ---------------------------------
    def _lock_pool(self, s: Session, pool: str, now: datetime) -> Breaker:
        """The pool's row, created if missing, row-locked on PostgreSQL for the rest of the
        transaction (SQLite: this transaction already holds the write lock)."""
        ins = pg_insert(P) if self._postgres else sqlite_insert(P)
        s.execute(ins.values(name=pool, consecutive_failures=0, failures_total=0,
                             updated_at=now).on_conflict_do_nothing(index_elements=["name"]))
        query = select(P).where(P.c.name == pool)
        if self._postgres:
            query = query.with_for_update()
        row = s.execute(query).one()
        return Breaker(row.name, row.consecutive_failures, row.failures_total, row.open_until,
                       row.last_error)

    @staticmethod
    def _read_pool(s: Session, pool: str) -> Breaker:
        row = s.execute(select(P).where(P.c.name == pool)).one_or_none()
        if row is None:
            return Breaker(pool)
        return Breaker(row.name, row.consecutive_failures, row.failures_total, row.open_until,
                       row.last_error)

    def _count_failure(self, s: Session, pool: str, error: str, policy: BreakerPolicy,
                       now: datetime) -> Breaker:
        was = self._lock_pool(s, pool, now)
        failures = was.consecutive_failures + 1
        open_until = (now + timedelta(seconds=policy.backoff(failures))
                      if failures >= policy.threshold else None)
        now_open = Breaker(pool, failures, was.failures_total + 1, open_until,
                           error[:LAST_ERROR_CHARS])
        s.execute(update(P).where(P.c.name == pool).values(
            consecutive_failures=now_open.consecutive_failures,
            failures_total=now_open.failures_total, open_until=open_until,
            last_error=now_open.last_error, updated_at=now))
        return now_open

    def breakers(self) -> dict[str, Breaker]:
        """Every pool that ever had a row (declared now or not), by name."""
        with self.store.tx() as s:
            return {row.name: Breaker(row.name, row.consecutive_failures, row.failures_total,
                                      row.open_until, row.last_error)
                    for row in s.execute(select(P).order_by(P.c.name))}

    def _counts(self, s: Session, pool: str) -> dict[str, int]:
        counts = dict.fromkeys(MEMBER_STATES, 0)
        for state, n in s.execute(select(L.c.state, func.count()).where(
                *unclaimed(pool), L.c.state.in_(MEMBER_STATES)).group_by(L.c.state)):
            counts[LeaseState(state)] = int(n)
        return {str(k): v for k, v in counts.items()}

    @staticmethod
    def _claiming(s: Session, pool: str) -> int:
        """Members of ``pool`` taken by a claim that has not ended yet (provisioning, a run
        bound, ``claimed_at`` set: a cold start has none); the state-led index finds them."""
        return int(s.scalar(select(func.count()).where(
            L.c.state == LeaseState.PROVISIONING, L.c.pool == pool,
            L.c.claimed_at.is_not(None), L.c.run_id.is_not(None))) or 0)

    def member_counts(self, pools: Iterable[str]) -> dict[str, dict[str, int]]:
        """Unclaimed members that exist, by pool and state (each pool an index range)."""
        with self.store.tx() as s:
            return {pool: self._counts(s, pool) for pool in pools}

    # -- sweep.fill_pools ----------------------------------------------------------------
    def fill(self, target: FillTarget, policy: BreakerPolicy, task_id: str | None,
             dry_run: bool = False) -> Filled:
        """Top the pool up in one transaction under its row lock (see the module's doc).
        A dry run only reads (no lock, no pool row created) and says what it would do.

        A template the provider refuses (``target.refused``) can never make a member: where
        members would be created (the breaker closed, or half open and no probe under way)
        that is one failure on the breaker, recorded with the refusal as its last error,
        as a failed create is; so the breaker opens, and backs off, as for any fill that
        cannot succeed. Once the provider accepts the template again (it was changed), the
        refusals say nothing of it: the breaker they opened closes, and the fill goes on."""
        now = utcnow()
        with self.store.tx() as s:
            breaker = (self._read_pool(s, target.pool) if dry_run
                       else self._lock_pool(s, target.pool, now))
            if target.refused is None and breaker.refused:
                breaker = Breaker(breaker.name, 0, breaker.failures_total, None,
                                  breaker.last_error)
                if not dry_run:
                    s.execute(update(P).where(P.c.name == target.pool).values(
                        consecutive_failures=0, open_until=None, updated_at=now))
            counts = self._counts(s, target.pool)
            state = breaker.state(policy.threshold, now)
            if state == BreakerState.OPEN:
                return Filled(FillDecision.BREAKER_OPEN, [], counts, breaker)
            live = counts[LeaseState.PROVISIONING] + counts[LeaseState.WARM]
            # A member being claimed is no longer counted (it is the run's), but it still
            # exists, and comes back as a member (pending_cleanup) if its claim fails: it
            # keeps its place under max_size until its claim ends (release locks this row).
            claiming = self._claiming(s, target.pool)
            room = min(target.size - live, target.max_size - sum(counts.values()) - claiming,
                       target.batch)
            if state == BreakerState.HALF_OPEN:
                if counts[LeaseState.PROVISIONING]:  # the probe is still under way
                    return Filled(FillDecision.PROBING, [], counts, breaker)
                room = min(room, 1)
            if room <= 0:
                return Filled(FillDecision.FULL if live >= target.size
                              else FillDecision.AT_MAX_SIZE, [], counts, breaker)
            if target.refused is not None:
                if not dry_run:
                    breaker = self._count_failure(s, target.pool, target.refused, policy, now)
                return Filled(FillDecision.REFUSED, [], counts, breaker, room)
            decision = (FillDecision.PROBING if state == BreakerState.HALF_OPEN
                        else FillDecision.CREATED)
            if dry_run:
                return Filled(decision, [], counts, breaker, room)
            ids = [target.new_id() for _ in range(room)]
            s.execute(insert(L), [self._member_row(target, lease_id, now) for lease_id in ids])
            probe = " (half-open probe)" if state == BreakerState.HALF_OPEN else ""
            s.execute(insert(E), [{"lease_id": lease_id, "at": now, "from_state": None,
                                   "to_state": LeaseState.PROVISIONING, "task_id": task_id,
                                   "reason": f"member intent recorded for pool "
                                             f"{target.pool}{probe}"}
                                  for lease_id in ids])
        return Filled(decision, ids, counts, breaker, room)

    def extend_member_deadline(self, lease_id: str, until: datetime) -> int:
        """A pool.provision at work (or about to retry): sweep.stuck_provisioning must not
        take its member meanwhile. Returns the number of members moved (0 or 1)."""
        with self.store.tx() as s:
            return int(cast(Any, s.execute(
                update(L).where(L.c.lease_id == lease_id, L.c.run_id.is_(None),
                                L.c.state == LeaseState.PROVISIONING)
                .values(acquire_deadline_at=until))).rowcount)

    @staticmethod
    def _member_row(target: FillTarget, lease_id: str, now: datetime) -> dict[str, Any]:
        key = f"pool:{target.pool}:{lease_id}"
        return {"lease_id": lease_id, "sandbox_key": key, "live_key": key,
                "provider": target.provider, "provider_lease_id": target.name_for(lease_id),
                "backend": None, "provider_meta": {}, "state": LeaseState.PROVISIONING,
                "reuse": False, "tenant": target.tenant, "thread_id": None, "run_id": None,
                "spec": target.spec, "created_at": now, "updated_at": now,
                "ready_at": None, "idle_deadline_at": None, "next_cleanup_at": None,
                "end_reason": None, "last_error": None, "cleanup_attempts": 0, "version": 1,
                "acquire_deadline_at": now + timedelta(seconds=target.acquire_timeout_s),
                "deadline_at": now + timedelta(seconds=target.max_age_s),
                "idle_timeout_s": target.idle_timeout_s, "pool": target.pool,
                "claimed_at": None}

    # -- pool.provision ------------------------------------------------------------------
    def member_ready(self, lease_id: str, pool: str, backend: str, meta: dict[str, Any],
                     reason: str, task_id: str | None, policy: BreakerPolicy) -> bool:
        """provisioning → warm, and the pool's breaker closes, in one transaction; unless
        the last failure it counted was a warm member's exit within the longest backoff:
        a template whose command exits becomes ready every time, so readiness proves
        nothing until its members have stayed warm that long."""
        now = utcnow()
        with self.store.tx() as s:
            won = move(s, self.store, lease_id, LeaseState.PROVISIONING, LeaseState.WARM,
                       reason, task_id, UNCLAIMED, {}, backend=backend, provider_meta=meta,
                       ready_at=now)
            if won:
                exited_lately = and_(
                    P.c.last_error.startswith(WARM_EXIT, autoescape=True),
                    P.c.updated_at > now - timedelta(seconds=policy.backoff_max_s))
                s.execute(update(P).where(P.c.name == pool, P.c.consecutive_failures > 0,
                                          not_(exited_lately))
                          .values(consecutive_failures=0, open_until=None, updated_at=now))
        return won

    def member_failed(self, lease_id: str, pool: str, reason: str, error: str,
                      end_reason: str, policy: BreakerPolicy, next_cleanup_at: datetime,
                      task_id: str | None, **found: Any) -> Breaker | None:
        """An unclaimed member that did not become ready: provisioning → pending_cleanup
        (to be destroyed), counted by the pool's breaker, in one transaction. None if the
        member had moved on (another worker won)."""
        now = utcnow()
        with self.store.tx() as s:
            if not move(s, self.store, lease_id, LeaseState.PROVISIONING,
                        LeaseState.PENDING_CLEANUP, reason, task_id, UNCLAIMED, {},
                        end_reason=end_reason[:64],
                        last_error=error[:LAST_ERROR_CHARS], next_cleanup_at=next_cleanup_at,
                        **found):
                return None
            return self._count_failure(s, pool, error, policy, now)

    # -- lease.acquire with spec.pool ----------------------------------------------------
    def claim(self, intent: ClaimIntent, task_id: str | None) -> LeaseRecord | None:
        """The oldest warm member of the pool, now the run's (provisioning until its claim
        is delivered), bound to the run, with its event: one transaction, one statement on
        PostgreSQL (models/rawsql.py). None when the pool has no warm member.
        Raises LiveLeaseExists when the run's sandbox key already has a live lease, and
        RunRebound when another copy of the run's acquire bound the run first."""
        claim = {"pool": intent.pool, "run_id": intent.run_id, "tenant": intent.tenant,
                 "thread_id": intent.thread_id, "sandbox_key": intent.sandbox_key,
                 "reuse": intent.reuse, "spec": intent.spec,
                 "acquire_deadline_at": intent.acquire_deadline_at,
                 "deadline_at": intent.deadline_at, "idle_timeout_s": intent.idle_timeout_s,
                 "bound_lease": intent.bound_lease}
        store = self.store
        try:
            with store.raw_tx() as cur:
                member = store.raw.claim_member(
                    cur, claim, f"claimed from pool {intent.pool} by run {intent.run_id}",
                    task_id, utcnow())
        except store.dbapi.IntegrityError:
            raise LiveLeaseExists(
                f"sandbox key {intent.sandbox_key!r} already has a live lease") from None
        if member is None:  # no warm member, or the run ended: the claim takes none then
            run = store.get_run(intent.run_id)
            if run is not None and run.status != RunStatus.RUNNING:
                raise InvalidRequest(f"run {intent.run_id} is no longer running "
                                     f"({run.status}); start a new run to get a sandbox")
            if run is not None and run.lease_id not in (None, intent.bound_lease):
                raise RunRebound(f"run {intent.run_id} was bound to lease {run.lease_id} "
                                 "meanwhile")
        return member

    def activate(self, lease_id: str, run_id: str, meta: dict[str, Any],
                 idle_deadline_at: datetime, reason: str, task_id: str | None) -> bool:
        """A claimed member whose run's data was delivered: provisioning → active for that
        run (guarded on both), its idle deadline starting now: the store's transition
        (one statement on PostgreSQL). False if another worker or sweep moved it first."""
        return self.store.transition(
            lease_id, {LeaseState.PROVISIONING}, LeaseState.ACTIVE, reason, task_id,
            guard="run_id = :g_run_id AND claimed_at IS NOT NULL",
            guard_params={"g_run_id": run_id}, provider_meta=meta,
            idle_deadline_at=idle_deadline_at) is not None

    def release(self, lease_id: str, run_id: str, reason: str, next_cleanup_at: datetime,
                task_id: str | None) -> bool:
        """A claimed member that turned out not resumable: provisioning → pending_cleanup,
        no longer the run's (the run is unbound, free for the next member or a cold
        start), counted as the pool's member until it is destroyed. One transaction, under
        the pool's row lock, so a fill always counts it, as claimed or as a member."""
        with self.store.tx() as s:
            pool = s.scalar(select(L.c.pool).where(L.c.lease_id == lease_id))
            if pool is not None:
                self._lock_pool(s, str(pool), utcnow())
            won = move(s, self.store, lease_id, LeaseState.PROVISIONING,
                       LeaseState.PENDING_CLEANUP, reason, task_id, "run_id = :g_run_id",
                       {"g_run_id": run_id}, end_reason="not_resumable",
                       last_error=reason[:LAST_ERROR_CHARS], run_id=None,
                       next_cleanup_at=next_cleanup_at)
            if won:
                s.execute(update(R).where(R.c.run_id == run_id, R.c.lease_id == lease_id)
                          .values(lease_id=None))
        return won

    # -- draining ------------------------------------------------------------------------
    def due_drains(self, rules: Mapping[str, DrainRule], now: datetime) -> list[Drain]:
        """Every warm member to drain now, oldest first within each pool: of a pool no
        longer declared, made from another template, past its max age, or beyond a
        shrunk pool's size."""
        drains: list[Drain] = []
        with self.store.tx() as s:
            warm = s.execute(select(L.c.lease_id, L.c.pool, L.c.deadline_at, L.c.spec)
                             .where(L.c.state == LeaseState.WARM, L.c.pool.is_not(None))
                             .order_by(L.c.pool, L.c.created_at, L.c.lease_id)).all()
            by_pool: dict[str, list[Any]] = {}
            for row in warm:
                by_pool.setdefault(str(row.pool), []).append(row)
            for pool, members in by_pool.items():
                rule = rules.get(pool)
                if rule is None:
                    drains += [Drain(m.lease_id, pool, DrainKind.REMOVED) for m in members]
                    continue
                kept = []
                for m in members:
                    if m.spec != rule.spec:
                        drains.append(Drain(m.lease_id, pool, DrainKind.STALE))
                    elif m.deadline_at <= now:
                        drains.append(Drain(m.lease_id, pool, DrainKind.EXPIRED))
                    else:
                        kept.append(m)
                provisioning = self._counts(s, pool)[LeaseState.PROVISIONING]
                excess = max(len(kept) + provisioning - rule.size, 0)
                drains += [Drain(m.lease_id, pool, DrainKind.EXCESS)
                           for m in kept[:min(excess, len(kept))]]
        return drains

    def claim_drains(self, drains: Sequence[Drain], claim_s: float, task_id: str | None
                     ) -> list[Drain]:
        """warm → pending_cleanup for each still warm (a claim may have won it), its destroy
        claimed for ``claim_s``; skipping rows another transaction has locked."""
        now = utcnow()
        won: list[Drain] = []
        with self.store.tx() as s:
            query = select(L.c.lease_id).where(L.c.lease_id.in_([d.lease_id for d in drains]),
                                               L.c.state == LeaseState.WARM)
            if self._postgres:
                query = query.with_for_update(skip_locked=True)
            still = set(s.scalars(query))
            for drain in drains:
                if drain.lease_id in still and move(
                        s, self.store, drain.lease_id, LeaseState.WARM,
                        LeaseState.PENDING_CLEANUP,
                        f"drained from pool {drain.pool}: {_DRAIN_REASONS[drain.kind]}",
                        task_id, UNCLAIMED, {}, end_reason=f"pool_{drain.kind}",
                        next_cleanup_at=now + timedelta(seconds=claim_s)):
                    won.append(drain)
        return won

    def retire_exited(self, exits: Mapping[str, str], claim_s: float, task_id: str | None,
                      policy: BreakerPolicy, dry_run: bool = False) -> list[str]:
        """Warm members among ``exits`` (lease id → how its command exited by itself):
        pending_cleanup, their destroys claimed for ``claim_s`` (no run will ever want
        them), each counted by its pool's breaker (a member must wait for its run's data:
        one that exits is a failure of the template). A dry run only says which."""
        if not exits:
            return []
        now = utcnow()
        with self.store.tx() as s:
            query = select(L.c.lease_id, L.c.pool).where(L.c.lease_id.in_(list(exits)),
                                                         L.c.state == LeaseState.WARM)
            if dry_run:
                return [row.lease_id for row in s.execute(query)]
            if self._postgres:
                query = query.with_for_update(skip_locked=True)
            retired = []
            for lease_id, pool in s.execute(query).all():
                if move(s, self.store, lease_id, LeaseState.WARM, LeaseState.PENDING_CLEANUP,
                        "its command exited while it was warm", task_id, UNCLAIMED, {},
                        end_reason="pool_member_exited",
                        next_cleanup_at=now + timedelta(seconds=claim_s)):
                    retired.append(lease_id)
                    self._count_failure(s, pool, f"{WARM_EXIT} ({exits[lease_id]}): its "
                                        "template must keep running until its run's data "
                                        "arrives", policy, now)
            return retired


_DRAIN_REASONS = {
    DrainKind.EXPIRED: "warm past the pool's max_age_s",
    DrainKind.EXCESS: "more members than the pool's size",
    DrainKind.REMOVED: "the pool is no longer declared",
    DrainKind.STALE: "made from another template than the pool's current one",
}
