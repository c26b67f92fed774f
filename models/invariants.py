"""The lifecycle's invariants over the store, checked by ``leasekeeper check``.

Each rule is a read-only query; a row it returns is a record that does not tell the truth:

- ``run-on-ended-lease``: a run says running or interrupted, yet its own lease is
  destroyed or abandoned (its sandbox is gone, or given up on);
- ``live-lease-without-run``: a lease is provisioning, warm or active, yet its run row is
  gone (or it never had one), unless it is an unclaimed warm pool member (``pool`` set, no
  run: it is its pool's until a run claims it);
- ``pool-over-max-size``: a pool has more unclaimed members that exist (provisioning,
  warm, or being drained) than its ``max_size`` (only for the pools given);
- ``unreclaimed-ephemeral-lease``: a run finished more than the claim timeout ago, yet its
  own (not reused) lease is still provisioning or active: nobody is reclaiming it;
- ``run-without-lease``: a run has said running with no lease for longer than any acquire
  can be alive without recording one (``leaseless_grace_s``): nobody will give it one
  (``sweep.reap_runs`` fails such runs);
- ``reclaim-outcome-mismatch``: the run's reclaim outcome contradicts its lease's state
  (``destroyed`` but the lease is not; ``destroy-failed`` but the lease is destroyed or
  live; ``not-found`` while the lease, last bound to this very run, is abandoned).

Rows whose lease record is missing are not judged here: ``sweep.orphans`` finds what such
a lease left behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import and_, func, not_, or_, select

from models.pool_store import MEMBER_STATES
from models.schema import (
    FINAL_STATES,
    LIVE_STATES,
    TERMINAL_RUN_STATUSES,
    Lease,
    LeaseState,
    ReclaimOutcome,
    Run,
    RunStatus,
)
from models.store import Store, leaseless

UNFINISHED = [RunStatus.RUNNING, RunStatus.INTERRUPTED]


class Rule(StrEnum):
    RUN_ON_ENDED_LEASE = "run-on-ended-lease"
    LIVE_LEASE_WITHOUT_RUN = "live-lease-without-run"
    POOL_OVER_MAX_SIZE = "pool-over-max-size"
    UNRECLAIMED_EPHEMERAL_LEASE = "unreclaimed-ephemeral-lease"
    RUN_WITHOUT_LEASE = "run-without-lease"
    RECLAIM_OUTCOME_MISMATCH = "reclaim-outcome-mismatch"


@dataclass(frozen=True)
class Violation:
    rule: Rule
    lease_id: str | None
    run_id: str | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rule": self.rule.value}

    def describe(self) -> str:
        return f"{self.rule}: lease {self.lease_id or '-'} run {self.run_id or '-'}: {self.detail}"


def check(store: Store, now: datetime, claim_timeout_s: float,
          pool_max_sizes: Mapping[str, int] | None = None,
          leaseless_grace_s: float | None = None) -> list[Violation]:
    """Every violation in the store now, rule by rule, oldest first (one transaction).
    ``pool_max_sizes``: the declared pools' max_size by name; ``leaseless_grace_s``:
    settings.leaseless_run_grace_s (None: that rule is not checked)."""
    found: list[Violation] = []
    both = Run.__table__.join(Lease.__table__, Lease.lease_id == Run.lease_id)
    with store.tx() as s:
        for run_id, status, lease_id, state, end_reason in s.execute(
                select(Run.run_id, Run.status, Lease.lease_id, Lease.state, Lease.end_reason)
                .select_from(both)
                .where(Run.status.in_(UNFINISHED), Lease.state.in_(list(FINAL_STATES)))
                .order_by(Run.started_at)):
            found.append(Violation(Rule.RUN_ON_ENDED_LEASE, lease_id, run_id,
                                   f"run is {status} but its lease is {state} ({end_reason})"))

        for live_id, live_state, bound_run in s.execute(
                select(Lease.lease_id, Lease.state, Lease.run_id)
                .select_from(Lease.__table__.outerjoin(Run.__table__,
                                                       Run.run_id == Lease.run_id))
                .where(Lease.state.in_(list(LIVE_STATES)), Run.run_id.is_(None),
                       not_(and_(Lease.pool.is_not(None), Lease.run_id.is_(None))))
                .order_by(Lease.created_at)):
            found.append(Violation(Rule.LIVE_LEASE_WITHOUT_RUN, live_id, bound_run,
                                   f"lease is {live_state} but its run "
                                   f"{'row is gone' if bound_run else 'was never recorded'}"))

        for pool, max_size in sorted((pool_max_sizes or {}).items()):
            members = int(s.scalar(select(func.count()).where(
                Lease.pool == pool, Lease.run_id.is_(None),
                Lease.state.in_(MEMBER_STATES))) or 0)
            if members > max_size:
                found.append(Violation(Rule.POOL_OVER_MAX_SIZE, None, None,
                                       f"pool {pool} has {members} members, over its "
                                       f"max_size {max_size}"))

        cutoff = now - timedelta(seconds=claim_timeout_s)
        for run_id, status, finished_at, lease_id, state in s.execute(
                select(Run.run_id, Run.status, Run.finished_at, Lease.lease_id, Lease.state)
                .select_from(both)
                .where(Run.status.in_(list(TERMINAL_RUN_STATUSES)), Run.finished_at <= cutoff,
                       Lease.reuse.is_(False), Lease.state.in_(list(LIVE_STATES)))
                .order_by(Run.finished_at)):
            found.append(Violation(
                Rule.UNRECLAIMED_EPHEMERAL_LEASE, lease_id, run_id,
                f"run {status} at {finished_at and finished_at.isoformat()}Z, more than "
                f"{claim_timeout_s:g}s ago, but its ephemeral lease is still {state}"))

        if leaseless_grace_s is not None:
            since = now - timedelta(seconds=leaseless_grace_s)
            for run_id, started_at in s.execute(
                    select(Run.run_id, Run.started_at).where(*leaseless(since))
                    .order_by(Run.started_at)):
                found.append(Violation(
                    Rule.RUN_WITHOUT_LEASE, None, run_id,
                    f"running since {started_at.isoformat()}Z with no lease, over "
                    f"{leaseless_grace_s:g}s: its acquire will not give it one"))

        contradictions = or_(
            and_(Run.reclaim_outcome == ReclaimOutcome.DESTROYED,
                 Lease.state != LeaseState.DESTROYED),
            and_(Run.reclaim_outcome == ReclaimOutcome.DESTROY_FAILED,
                 Lease.state.in_([LeaseState.DESTROYED, *LIVE_STATES])),
            and_(Run.reclaim_outcome == ReclaimOutcome.NOT_FOUND,
                 Lease.state == LeaseState.ABANDONED, Lease.run_id == Run.run_id),
        )
        for run_id, outcome, lease_id, state in s.execute(
                select(Run.run_id, Run.reclaim_outcome, Lease.lease_id, Lease.state)
                .select_from(both).where(contradictions).order_by(Run.finished_at)):
            found.append(Violation(Rule.RECLAIM_OUTCOME_MISMATCH, lease_id, run_id,
                                   f"reclaim outcome {outcome} but the lease is {state}"))
    return found
