"""``sweep.finish_exited``: a run whose sandbox command ended by itself gets finished.

Every enabled provider lists what it manages; a resource whose ``exit_code`` is known
(a local process's exit sentinel, a finished Kubernetes Job) finishes every still-running
run bound to its lease (a thread's runs reusing one sandbox are all bound to it, not only
its latest): ``completed`` for exit code 0, ``failed`` otherwise, the exit code recorded.
A resource the provider reports as stopped before its command exited (``exit_reason``,
e.g. a Job killed by its active deadline: ``DeadlineExceeded``) finishes its runs as
``failed`` with that reason and no exit code. Each run goes through run.finish's own code
path (``tasks.runs.finish``), so its reclaim is enqueued exactly when run.finish would
enqueue it (never for a reused sandbox's runs); each run counts against the batch.
A resume check that finds the exit first records the runs the same way (tasks/resume.py;
``tasks.runs.exited_run`` is the one mapping): the record does not depend on who noticed.
Unknown (no ``exit_code`` and no ``exit_reason``) is never taken for finished; a
process group killed outright leaves no code (the local provider reports it as
``exit_reason``), and while its lease is being destroyed that is most likely the
destroy's own kill: such a run is left to the lease's end, which settles it. The guarded
finish is the claim: of two overlapping ticks, only one changes the run and enqueues its
reclaim. A warm pool member whose command exited (it has no run) is no use to any run: it
goes warm → pending_cleanup and is destroyed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from models.pool_store import PoolStore
from models.schema import LeaseState, RunStatus
from models.store import RunChange, RunEnd
from tasks.base import LeaseTask
from tasks.pool_fill import breaker_policy
from tasks.runs import exited_run, finish
from tasks.sweeping import Summary, SweepContext, Tally, list_providers, sweep_task
from workers.app import app

NAME = "sweep.finish_exited"


class ExitedOutcome(StrEnum):
    COMPLETED = "completed"  # exit code 0: the run was finished as completed
    FAILED = "failed"  # non-zero exit code, or stopped (exit_reason): finished as failed
    RECLAIMS_ENQUEUED = "reclaims_enqueued"  # sandbox.reclaim sent for a finished run
    ALREADY_FINISHED = "already_finished"  # another finish won the guarded update
    NOT_YET_ACTIVE = "not_yet_active"  # the lease is still provisioning: next tick
    DEFERRED = "deferred"  # beyond this tick's batch: next tick
    WARM_EXITED = "warm_exited"  # a warm pool member's command exited: drained, destroy sent
    LIST_FAILED = "list_failed"  # a provider could not list its resources: next tick
    LEASE_ENDING = "lease_ending"  # stopped, no exit code, its lease being destroyed: left
    #                                to the lease's end, which settles its runs


_ENDING = frozenset({LeaseState.DESTROYING, LeaseState.PENDING_CLEANUP})


@dataclass(frozen=True)
class _Exit:
    provider: str
    code: int | None  # None: stopped before its command exited, for ``reason``
    reason: str | None

    @property
    def detail(self) -> str:
        return f"exit code {self.code}" if self.code is not None else f"{self.reason}, no exit code"

    @property
    def ended(self) -> RunEnd:
        return exited_run(self.code, self.reason)


def finish_exited(ctx: SweepContext) -> Tally:
    rt, tally = ctx.rt, Tally(ExitedOutcome)
    exited: dict[str, _Exit] = {}  # lease id → how its sandbox ended
    for listing in list_providers(rt):
        if listing.error is not None:
            tally.add(ExitedOutcome.LIST_FAILED, listing.provider, listing.error)
            continue
        for resource in listing.resources:
            if not resource.lease_id:
                continue
            if resource.exit_code is not None or resource.exit_reason:
                exited[resource.lease_id] = _Exit(listing.provider, resource.exit_code,
                                                  resource.exit_reason)
    for lease_id in PoolStore(rt.store).retire_exited(
            {lease_id: e.detail for lease_id, e in exited.items()},
            rt.settings.claim_timeout_s, ctx.task_id, breaker_policy(rt.settings),
            ctx.dry_run):
        if not ctx.dry_run:
            ctx.effects.destroy(lease_id, "pool member exited while warm")
        tally.add(ExitedOutcome.WARM_EXITED, lease_id, exited[lease_id].detail)
    budget = rt.settings.sweep_batch_size
    for lease, run in rt.store.unfinished_runs_on_leases(list(exited)):
        ended = exited[lease.lease_id]
        if lease.provider != ended.provider:  # listed by another provider: not this lease's
            continue
        if lease.state == LeaseState.PROVISIONING:
            tally.add(ExitedOutcome.NOT_YET_ACTIVE, lease.lease_id)
            continue
        if ended.code is None and lease.state in _ENDING:
            # stopped with no exit code while its lease is being destroyed: most likely by
            # that destroy (it kills the process group); the lease's end settles its runs
            tally.add(ExitedOutcome.LEASE_ENDING, run.run_id)
            continue
        if budget == 0:
            tally.add(ExitedOutcome.DEFERRED, run.run_id)
            continue
        budget -= 1
        end = ended.ended
        outcome = (ExitedOutcome.COMPLETED if end.status == RunStatus.COMPLETED
                   else ExitedOutcome.FAILED)
        if ctx.dry_run:
            tally.add(outcome, run.run_id, ended.detail)
            continue
        change, reclaim_now = finish(rt, run.run_id, end.status, end.exit_code, end.error,
                                     own_text=True)
        if change == RunChange.UNCHANGED:
            tally.add(ExitedOutcome.ALREADY_FINISHED, run.run_id)
            continue
        tally.add(outcome, run.run_id, ended.detail)
        if reclaim_now:
            ctx.effects.reclaim(run.run_id)
            tally.add(ExitedOutcome.RECLAIMS_ENQUEUED)
    return tally


@app.task(bind=True, base=LeaseTask, name=NAME)
def finish_exited_task(self: LeaseTask) -> Summary:
    return sweep_task(self, NAME, finish_exited)
