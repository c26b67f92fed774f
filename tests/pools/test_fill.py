"""sweep.fill_pools and pool.provision over a real store (SQLite and PostgreSQL) and real
local sandboxes: filling to size in bounded batches, max_size under concurrent fillers
and racing claims (store and provider), the circuit breaker on a pool whose creates fail
(and no multiplying of sandboxes that never become ready: agent-sandbox #1215), draining
by age, shrink, removal and template change, and the other sweeps seeing pool members."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from models.pool_store import BreakerState, PoolStore
from models.schema import LeaseState, utcnow
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tasks.pool_fill import FillOutcome
from tests.e2e.conftest import eventually, until_gone
from tests.pools.conftest import (
    PoolRecorder,
    fill,
    members,
    pool,
    sandboxes,
    warm,
)
from tests.sweeps.conftest import concurrently, events_to, set_lease
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def breaker(rt: Runtime, name: str = "py") -> Any:
    return PoolStore(rt.store).breakers()[name]


def member_sandboxes(rt: Runtime, provider: str = "local") -> set[str]:
    """Sandboxes the provider really has that belong to no run (pool members)."""
    runs = {lease.provider_lease_id for lease in rt.store.leases() if lease.run_id}
    return sandboxes(rt, provider) - runs


# -- filling ---------------------------------------------------------------------------
def test_a_tick_fills_the_pool_to_size_and_the_next_creates_nothing(
        rt: Runtime, effects: PoolRecorder) -> None:
    first = fill(rt, effects)
    assert first["created"] == 2 and first["full"] == 0
    ready = warm(rt)
    assert len(ready) == 2 and all(m.ready_at and m.backend == "process" for m in ready)
    assert {m.provider_lease_id for m in ready} == sandboxes(rt)
    for member in ready:  # a lease like any other: intent first, then ready, in its history
        assert [(e.from_state, e.to_state) for e in rt.store.events(member.lease_id)] == [
            (None, "provisioning"), ("provisioning", "warm")]
        assert member.sandbox_key == f"pool:py:{member.lease_id}" and member.run_id is None
        assert member.deadline_at - member.created_at == timedelta(seconds=3600)
    again = fill(rt, effects)
    assert again["created"] == 0 and again["full"] == 1
    assert len(members(rt)) == 2 and len(sandboxes(rt)) == 2


def test_each_tick_creates_at_most_the_pools_batch(runtime_with: Callable[..., Runtime]
                                                   ) -> None:
    rt = runtime_with(pools=[pool(size=5, fill_batch_size=2)])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    assert [fill(rt, effects)["created"] for _ in range(4)] == [2, 2, 1, 0]
    assert len(warm(rt)) == 5 == len(sandboxes(rt))


def test_every_member_gets_the_pool_label_and_a_private_run_directory(
        rt: Runtime, effects: PoolRecorder) -> None:
    import json
    from pathlib import Path

    fill(rt, effects)
    member = warm(rt)[0]
    workspace = Path(member.provider_meta["workspace"])
    record = json.loads((workspace / "lease.json").read_text())
    assert record["labels"]["leasekeeper.dev/pool"] == "py"
    assert (workspace / "run").stat().st_mode & 0o777 == 0o700
    assert list((workspace / "run").iterdir()) == []  # nothing until a run claims it


def test_max_size_holds_with_concurrent_fillers_and_racing_claims(
        runtime_with: Callable[..., Runtime]) -> None:
    """Eight fillers at once, with claims racing them: the store never holds more than
    max_size unclaimed members (sampled all along), and neither does the provider."""
    from tasks.acquire import acquire_lease

    rt = runtime_with(pools=[pool(size=3, max_size=4, fill_batch_size=4)])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        pools = PoolStore(rt.store)
        while not stop.is_set():
            seen.append(sum(pools.member_counts(["py"])["py"].values()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    claimed: list[str] = []
    try:
        def claim(run_id: str) -> Callable[[], Any]:
            return lambda: acquire_lease(rt, run_id, SandboxSpec(pool="py"), None, False)

        for round_ in range(4):
            calls: list[Callable[[], Any]] = [lambda: fill(rt, effects) for _ in range(8)]
            calls += [claim(f"run-{round_}-{i}") for i in range(2)]
            for result in concurrently(calls):
                if hasattr(result, "lease_id"):
                    claimed.append(result.lease_id)
                assert len(member_sandboxes(rt)) <= 4
    finally:
        stop.set()
        sampler.join(30)
    assert seen and max(seen) <= 4, max(seen)
    unclaimed = [m for m in members(rt) if m.state != LeaseState.DESTROYED]
    assert len(unclaimed) <= 4 and len(member_sandboxes(rt)) <= 4
    assert len(set(claimed)) == len(claimed) == 8  # every claim its own lease


def test_concurrent_fill_transactions_never_overshoot(
        runtime_with: Callable[..., Runtime]) -> None:
    """The bare guarded fill, many at once (no provisioning): one member is missing, and of
    twelve fillers exactly one records it."""
    from models.pool_store import FillTarget
    from tasks.leases import new_lease_id
    from tasks.pool_fill import breaker_policy

    rt = runtime_with(pools=[pool(size=5, max_size=5, fill_batch_size=5)])
    pools = PoolStore(rt.store)
    target = FillTarget(pool="py", size=5, max_size=5, batch=5, provider="local",
                        tenant="default", spec={}, max_age_s=60, acquire_timeout_s=60,
                        idle_timeout_s=60, name_for=lambda i: f"lk-{i}", new_id=new_lease_id)
    policy = breaker_policy(rt.settings)
    # the pool's row exists (as after its first tick): nothing but the row lock orders them
    assert len(pools.fill(target, policy, None).lease_ids) == 5
    set_lease(rt, members(rt)[0].lease_id, state=LeaseState.DESTROYED, live_key=None)
    results = concurrently([lambda: pools.fill(target, policy, None) for _ in range(12)])
    assert sum(len(r.lease_ids) for r in results) == 1
    assert len([m for m in members(rt) if m.state != LeaseState.DESTROYED]) == 5


# -- the circuit breaker -----------------------------------------------------------------
def test_a_pool_whose_creates_fail_opens_its_breaker_and_stops_creating(
        runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(pools=[pool(provider="faulty", size=3)], pool_breaker_threshold=2,
                      pool_breaker_backoff_s=60)
    faults = FaultPlan(rt.settings.faults_file)  # type: ignore[arg-type]
    # given creates that fail after the sandbox exists (the failed-acquire path destroys it)
    faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 100}]})
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    first = fill(rt, effects)
    assert first["created"] == 3 and len(effects.failed) == 3
    assert all(m.state == LeaseState.DESTROYED and m.end_reason == "acquire_failed"
               for m in members(rt))
    opened = breaker(rt)
    assert opened.consecutive_failures == 3 and opened.failures_total == 3
    assert opened.state(2, utcnow()) == BreakerState.OPEN
    assert "injected terminal fault" in (opened.last_error or "")
    # the backoff doubles past the threshold: 60 s at the 2nd failure, 120 s at the 3rd
    assert timedelta(seconds=110) < opened.open_until - utcnow() <= timedelta(seconds=120)
    # when more ticks come, nothing more is created, and the summary says why
    for _ in range(3):
        tick = fill(rt, effects)
        assert tick["breaker_open"] == 1 and tick["created"] == 0
    from tasks.pool_fill import fill_pools
    from tasks.sweeping import SweepContext

    items = fill_pools(SweepContext(rt, effects)).items
    assert any(i.startswith("breaker_open py (3 consecutive failures") for i in items), items
    assert len(members(rt)) == 3 and sandboxes(rt, "faulty") == set()


def test_a_half_open_breaker_probes_with_one_member_and_closes_when_it_is_ready(
        runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(pools=[pool(provider="faulty", size=3)], pool_breaker_threshold=2,
                      pool_breaker_backoff_s=30)
    faults = FaultPlan(rt.settings.faults_file)  # type: ignore[arg-type]
    faults.write({"acquire": [{"fault": "terminal", "times": 100}]})
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    fill(rt, effects)
    assert breaker(rt).consecutive_failures == 3

    def backoff_passes() -> None:
        with rt.store.tx() as s:
            from sqlalchemy import update

            from models.schema import Pool
            s.execute(update(Pool).values(open_until=utcnow() - timedelta(seconds=1)))

    # half open, still failing: one probe, which fails and reopens it for longer
    backoff_passes()
    probe = fill(rt, effects)
    assert probe["probing"] == 1 and probe["created"] == 0
    assert len(members(rt)) == 4
    reopened = breaker(rt)
    assert reopened.consecutive_failures == 4
    assert timedelta(seconds=110) < reopened.open_until - utcnow() <= timedelta(seconds=120)
    # half open, the provider fixed: the probe becomes ready and closes the breaker
    faults.write({})
    backoff_passes()
    assert fill(rt, effects)["probing"] == 1
    assert len(warm(rt)) == 1 and breaker(rt).consecutive_failures == 0
    assert breaker(rt).state(2, utcnow()) == BreakerState.CLOSED
    assert fill(rt, effects)["created"] == 2
    assert len(warm(rt)) == 3 == len(sandboxes(rt, "faulty"))


def test_members_that_never_become_ready_stay_counted_and_never_multiply(
        runtime_with: Callable[..., Runtime]) -> None:
    """agent-sandbox #1215: a pool whose sandboxes cannot become Ready created ~5x its size.
    Here the create keeps failing transiently after the sandbox exists (retried, never
    ready): the members stay provisioning and counted, tick after tick; past their acquire
    deadline sweep.stuck_provisioning destroys them, each a failure on the breaker."""
    from tasks.stuck import StuckOutcome, stuck_provisioning
    from tasks.sweeping import SweepContext

    rt = runtime_with(pools=[pool(provider="faulty", size=2, template={
        "command": ["sh", "-c", "exit 3"]})], pool_breaker_threshold=2)
    faults = FaultPlan(rt.settings.faults_file)  # type: ignore[arg-type]
    faults.write({"acquire": [{"fault": "transient", "when": "after", "times": 100}]})
    effects = PoolRecorder(rt, inline=True, inline_provision=True, may_retry=True)
    for _ in range(5):
        fill(rt, effects)
    stuck = members(rt, "py", LeaseState.PROVISIONING)
    assert len(stuck) == 2 and len(members(rt)) == 2  # 5 ticks, still 2: nothing multiplied
    assert len(sandboxes(rt, "faulty")) == 2
    for member in stuck:  # their command exits at once: the sweep finds them unhealthy
        until_gone(rt, "faulty", member.lease_id, "the member's process to exit")
        set_lease(rt, member.lease_id, acquire_deadline_at=utcnow())
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.DESTROY_ENQUEUED] == 2, tally.items
    assert all(m.state == LeaseState.DESTROYED and m.end_reason == "acquire_stuck"
               for m in members(rt))
    assert sandboxes(rt, "faulty") == set()
    assert breaker(rt).consecutive_failures == 2  # counted: the breaker is open now
    assert fill(rt, effects)["breaker_open"] == 1 and len(members(rt)) == 2


def test_a_stuck_member_that_is_healthy_is_adopted_back_into_its_pool(
        rt: Runtime, effects: PoolRecorder) -> None:
    from tasks.stuck import StuckOutcome, stuck_provisioning
    from tasks.sweeping import SweepContext

    fill(rt, effects)
    member = warm(rt)[0]
    # as if its pool.provision died after creating the sandbox, before recording it ready
    assert rt.store.transition(member.lease_id, {LeaseState.WARM}, LeaseState.PROVISIONING,
                               "as if", acquire_deadline_at=utcnow())
    assert stuck_provisioning(SweepContext(rt, effects))[StuckOutcome.ADOPTED] == 1
    adopted = rt.store.get_lease(member.lease_id)
    assert adopted.state == LeaseState.WARM and adopted.run_id is None
    assert adopted.idle_deadline_at is None


def test_a_provision_of_a_removed_pool_creates_nothing(
        rt: Runtime, runtime_with: Callable[..., Runtime]) -> None:
    from tasks.pool_fill import ProvisionResult, provision_member

    fill(rt, PoolRecorder(rt))  # member intents recorded, their provisions not run yet
    intents = members(rt, "py", LeaseState.PROVISIONING)
    assert len(intents) == 2 and sandboxes(rt) == set()
    removed = runtime_with(pools=[])
    done = provision_member(removed, intents[0].lease_id, None, may_retry=False)
    assert done.result == ProvisionResult.REMOVED
    assert rt.store.get_lease(intents[0].lease_id).state == LeaseState.DESTROYED
    assert sandboxes(rt) == set()


def test_a_template_the_provider_cannot_run_is_a_fill_failure_and_nothing_recorded(
        runtime_with: Callable[..., Runtime]) -> None:
    """QA: a refused template only reached the log; its pool's row (breaker, last error),
    and so `pools`, `status`, the metrics and the alert, said nothing."""
    from tasks.pool_fill import fill_pools
    from tasks.sweeping import SweepContext

    rt = runtime_with(pools=[pool(template={"command": ["no-such-program-xyz"]})],
                      pool_breaker_threshold=2, pool_breaker_backoff_s=60)
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    first = fill_pools(SweepContext(rt, effects))
    assert first[FillOutcome.TEMPLATE_REFUSED] == 1
    assert any(i.startswith("template_refused py (template refused: local: command "
                            "'no-such-program-xyz' not found") for i in first.items), first.items
    refused = breaker(rt)
    assert (refused.consecutive_failures, refused.failures_total) == (1, 1) and refused.refused
    assert refused.last_error.startswith("template refused: local: command "
                                         "'no-such-program-xyz' not found on the worker's PATH")
    assert refused.state(2, utcnow()) == BreakerState.CLOSED
    # a second refusal opens the breaker, as a second failed create would
    assert fill(rt, effects)["template_refused"] == 1
    opened = breaker(rt)
    assert opened.consecutive_failures == 2 and opened.state(2, utcnow()) == BreakerState.OPEN
    # while it is open the fill creates nothing and counts nothing more
    assert fill(rt, effects)["breaker_open"] == 1
    assert breaker(rt).failures_total == 2
    assert members(rt) == [] and sandboxes(rt) == set() and effects.provisions == []
    # a dry run says so and writes nothing
    assert fill_pools(SweepContext(rt, effects, dry_run=True))[FillOutcome.BREAKER_OPEN] == 1
    assert breaker(rt) == opened


def test_a_template_fixed_after_a_refusal_fills_at_once(
        runtime_with: Callable[..., Runtime]) -> None:
    """The refusals were the old template's: the breaker they opened says nothing of the
    new one, which the provider accepts, so the next tick fills (no backoff to wait)."""
    rt = runtime_with(pools=[pool(template={"command": ["no-such-program-xyz"]})],
                      pool_breaker_threshold=1, pool_breaker_backoff_s=600)
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    assert breaker(rt).state(1, utcnow()) == BreakerState.OPEN
    fixed = runtime_with(pools=[pool(template={"command": ["sleep", "600"]})],
                         pool_breaker_threshold=1, pool_breaker_backoff_s=600)
    assert fill(fixed, PoolRecorder(fixed, inline=True, inline_provision=True))["created"] == 2
    assert len(warm(fixed)) == 2
    closed = breaker(fixed)
    assert closed.state(1, utcnow()) == BreakerState.CLOSED and not closed.refused
    assert closed.failures_total == 1  # the refusal stays counted


# -- draining ----------------------------------------------------------------------------
def test_a_member_warm_past_max_age_is_drained_and_replaced(
        rt: Runtime, effects: PoolRecorder) -> None:
    fill(rt, effects)
    old, young = warm(rt)
    set_lease(rt, old.lease_id, deadline_at=utcnow() - timedelta(seconds=1))
    tick = fill(rt, effects)
    assert tick["expired"] == 1 and tick["created"] == 1
    gone = rt.store.get_lease(old.lease_id)
    assert gone.state == LeaseState.DESTROYED and gone.end_reason == "pool_expired"
    assert events_to(rt, old.lease_id, LeaseState.PENDING_CLEANUP, "max_age_s") == 1
    assert old.provider_lease_id not in sandboxes(rt)
    assert len(warm(rt)) == 2 and young.lease_id in {m.lease_id for m in warm(rt)}


def test_a_shrunk_pool_drains_its_oldest_members(
        rt: Runtime, effects: PoolRecorder, runtime_with: Callable[..., Runtime]) -> None:
    fill(rt, effects)
    oldest, newest = warm(rt)
    shrunk = runtime_with(pools=[pool(size=1)])
    tick = fill(shrunk, PoolRecorder(shrunk, inline=True, inline_provision=True))
    assert tick["excess"] == 1 and tick["created"] == 0
    assert rt.store.get_lease(oldest.lease_id).end_reason == "pool_excess"
    assert [m.lease_id for m in warm(rt)] == [newest.lease_id]
    assert sandboxes(rt) == {newest.provider_lease_id}


def test_a_removed_pool_drains_every_member_in_bounded_batches(
        runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(pools=[pool(size=3)])
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    gone = runtime_with(pools=[], sweep_batch_size=2)
    effects = PoolRecorder(gone, inline=True)
    first = fill(gone, effects)
    assert first["removed"] == 2 and first["deferred"] == 1
    assert fill(gone, effects)["removed"] == 1
    assert all(m.state == LeaseState.DESTROYED and m.end_reason == "pool_removed"
               for m in members(rt))
    assert sandboxes(rt) == set()


def test_members_of_an_older_template_are_replaced(
        rt: Runtime, effects: PoolRecorder, runtime_with: Callable[..., Runtime]) -> None:
    fill(rt, effects)
    before = {m.lease_id for m in warm(rt)}
    changed = runtime_with(pools=[pool(template={"env": {"VERSION": "2"}})])
    tick = fill(changed, PoolRecorder(changed, inline=True, inline_provision=True))
    assert tick["stale"] == 2 and tick["created"] == 2
    now_warm = warm(rt)
    assert not before & {m.lease_id for m in now_warm}
    assert all(m.spec["env"] == {"VERSION": "2"} for m in now_warm)
    assert len(sandboxes(rt)) == 2


def test_a_drain_never_takes_a_member_a_claim_took_first(
        rt: Runtime, effects: PoolRecorder) -> None:
    from models.pool_store import Drain, DrainKind
    from tasks.acquire import AcquireResult, acquire_lease

    fill(rt, effects)
    old = warm(rt)[0]
    done = acquire_lease(rt, "run-1", SandboxSpec(pool="py"), None, False)
    assert done.result == AcquireResult.CLAIMED and done.lease_id == old.lease_id
    won = PoolStore(rt.store).claim_drains([Drain(old.lease_id, "py", DrainKind.EXPIRED)], 5,
                                           None)
    assert won == [] and rt.store.get_lease(old.lease_id).state == LeaseState.ACTIVE


# -- the other sweeps see pool members ---------------------------------------------------
def test_a_warm_member_whose_command_exited_is_drained_by_finish_exited(
        runtime_with: Callable[..., Runtime]) -> None:
    from tasks.finish_exited import ExitedOutcome, finish_exited
    from tasks.sweeping import SweepContext

    rt = runtime_with(pools=[pool(size=1, template={"command": ["sh", "-c", "exit 4"]})])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    fill(rt, effects)
    (member,) = warm(rt)
    eventually(lambda: any(r.exit_code == 4 for r in rt.provider("local").list_managed()),
               30, "the member's command to exit")
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.WARM_EXITED] == 1
    ended = rt.store.get_lease(member.lease_id)
    assert ended.state == LeaseState.DESTROYED and ended.end_reason == "pool_member_exited"


def test_a_warm_member_killed_outright_is_drained_by_finish_exited(
        runtime_with: Callable[..., Runtime]) -> None:
    # Before: a member whose whole process group was SIGKILLed (the OOM killer, a lost
    # host) left no exit code, was listed only as alive=False, and stayed warm, counted in
    # `pools`, status and metrics, until max_age (1 h) or a claim tripped on it (a QA pass).
    import os
    import signal

    from tasks.finish_exited import ExitedOutcome, finish_exited
    from tasks.sweeping import SweepContext

    rt = runtime_with(pools=[pool(size=1)])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    fill(rt, effects)
    (member,) = warm(rt)
    (listed,) = [r for r in rt.provider("local").list_managed()
                 if r.lease_id == member.lease_id]
    os.killpg(int(listed.meta["pid"]), signal.SIGKILL)
    eventually(lambda: not any(r.meta["alive"] for r in rt.provider("local").list_managed()
                               if r.lease_id == member.lease_id), 30, "the member to die")
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.WARM_EXITED] == 1
    ended = rt.store.get_lease(member.lease_id)
    assert ended.state == LeaseState.DESTROYED and ended.end_reason == "pool_member_exited"


def test_a_template_whose_command_exits_opens_the_breaker_instead_of_churning(
        runtime_with: Callable[..., Runtime]) -> None:
    # Before: each member became ready (closing the breaker), exited, was drained and
    # replaced: 38 sandboxes in 3.5 minutes, the breaker closed and nothing said so.
    from tasks.finish_exited import ExitedOutcome, finish_exited
    from tasks.sweeping import SweepContext

    rt = runtime_with(pools=[pool(size=1, template={"command": ["sh", "-c", "exit 4"]})])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    for cycle in range(2):  # the threshold is 2
        assert fill(rt, effects)["created"] == 1, cycle
        eventually(lambda: any(r.exit_code == 4 for r in rt.provider("local").list_managed()),
                   30, "the member's command to exit")
        assert finish_exited(SweepContext(rt, effects))[ExitedOutcome.WARM_EXITED] == 1
    opened = breaker(rt)
    assert opened.consecutive_failures == 2 and opened.state(2, utcnow()) == BreakerState.OPEN
    assert "command exited (exit code 4)" in (opened.last_error or "")
    assert fill(rt, effects)["created"] == 0  # the churn stops


def test_orphans_tracks_members_and_records_one_whose_rows_were_lost(
        rt: Runtime, effects: PoolRecorder) -> None:
    import json
    from pathlib import Path

    from sqlalchemy import delete

    from models.schema import Lease, LeaseEvent
    from tasks.orphans import OrphanOutcome, orphans
    from tasks.sweeping import SweepContext

    fill(rt, effects)
    lost, kept = warm(rt)
    tally = orphans(SweepContext(rt, effects))
    assert tally[OrphanOutcome.TRACKED] == 2 and tally[OrphanOutcome.RECORDED] == 0
    with rt.store.tx() as s:  # behind the system's back: the member's rows are deleted
        s.execute(delete(LeaseEvent).where(LeaseEvent.lease_id == lost.lease_id))
        s.execute(delete(Lease).where(Lease.lease_id == lost.lease_id))
    record = Path(lost.provider_meta["workspace"]) / "lease.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "created_at": "2020-01-01T00:00:00+00:00"}))
    tally = orphans(SweepContext(rt, effects))
    assert tally[OrphanOutcome.RECORDED] == 1 and tally[OrphanOutcome.TRACKED] == 1
    assert rt.store.get_lease(lost.lease_id).state == LeaseState.DESTROYED
    assert sandboxes(rt) == {kept.provider_lease_id}


def test_expire_leases_leaves_warm_members_to_their_pool(
        rt: Runtime, effects: PoolRecorder) -> None:
    from tasks.sweeping import SweepContext
    from tasks.sweeps import expire_leases

    fill(rt, effects)
    for member in warm(rt):
        set_lease(rt, member.lease_id, idle_deadline_at=utcnow() - timedelta(seconds=1))
    assert sum(expire_leases(SweepContext(rt, effects)).counts.values()) == 0
    assert len(warm(rt)) == 2


def test_check_accepts_members_and_flags_a_pool_over_max_size(
        rt: Runtime, effects: PoolRecorder) -> None:
    from models.invariants import Rule, check
    from models.pool_store import FillTarget
    from tasks.leases import new_lease_id
    from tasks.pool_fill import breaker_policy

    fill(rt, effects)
    assert check(rt.store, utcnow(), 5, {"py": 2}) == []
    # behind the fill's back: a third member inserted without the pool's bounds
    target = FillTarget(pool="py", size=3, max_size=3, batch=1, provider="local",
                        tenant="default", spec={}, max_age_s=60, acquire_timeout_s=60,
                        idle_timeout_s=60, name_for=lambda i: f"lk-{i}", new_id=new_lease_id)
    PoolStore(rt.store).fill(target, breaker_policy(rt.settings), None)
    found = check(rt.store, utcnow(), 5, {"py": 2})
    assert [v.rule for v in found] == [Rule.POOL_OVER_MAX_SIZE]
    assert "pool py has 3 members, over its max_size 2" in found[0].detail


def test_a_dry_run_says_what_a_tick_would_do_and_changes_nothing(
        rt: Runtime, effects: PoolRecorder) -> None:
    from sqlalchemy import select

    from models.schema import Lease, LeaseEvent, Pool
    from tasks.pool_fill import fill_pools
    from tasks.sweeping import SweepContext

    def snapshot() -> list[Any]:
        with rt.store.tx() as s:
            return [list(s.execute(select(*t.__table__.c)).all())  # type: ignore[attr-defined]
                    for t in (Lease, LeaseEvent, Pool)]

    before = snapshot()
    dry = fill_pools(SweepContext(rt, effects, dry_run=True))
    assert dry[FillOutcome.CREATED] == 2 and "created (new) in py (py)" in dry.items
    assert snapshot() == before and effects.provisions == [] and sandboxes(rt) == set()
    fill(rt, effects)
    set_lease(rt, warm(rt)[0].lease_id, deadline_at=utcnow() - timedelta(seconds=1))
    before = snapshot()
    dry = fill_pools(SweepContext(rt, effects, dry_run=True))
    assert dry[FillOutcome.EXPIRED] == 1 and dry[FillOutcome.FULL] == 1
    assert snapshot() == before and effects.destroys == []


def test_a_member_being_claimed_keeps_its_place_under_max_size(
        runtime_with: Callable[..., Runtime]) -> None:
    """A claimed member is the run's, but until its claim ends it still exists and, if the
    claim fails, comes back as a member being destroyed: a fill meanwhile must leave it its
    place, or the pool has max_size + 1 members (the Kubernetes chaos test saw 5 of 4)."""
    from models.pool_store import ClaimIntent, FillTarget
    from tasks.leases import new_lease_id
    from tasks.pool_fill import breaker_policy

    rt = runtime_with(pools=[pool(size=3, max_size=3, fill_batch_size=3)])
    pools = PoolStore(rt.store)
    target = FillTarget(pool="py", size=3, max_size=3, batch=3, provider="local",
                        tenant="default", spec={}, max_age_s=60, acquire_timeout_s=60,
                        idle_timeout_s=60, name_for=lambda i: f"lk-{i}", new_id=new_lease_id)
    policy = breaker_policy(rt.settings)
    # given a full pool of warm members, one of them taken by a claim still under way
    assert len(pools.fill(target, policy, None).lease_ids) == 3
    for member in members(rt):
        set_lease(rt, member.lease_id, state=LeaseState.WARM)
    rt.store.start_run("run-1", None, "local", "sk-run-1")
    now = utcnow()
    taken = pools.claim(ClaimIntent(pool="py", run_id="run-1", sandbox_key="sk-run-1",
                                    tenant="default", thread_id=None, reuse=False, spec={},
                                    acquire_deadline_at=now + timedelta(minutes=1),
                                    deadline_at=now + timedelta(hours=1), idle_timeout_s=60),
                        None)
    assert taken is not None
    # when a fill runs, then the claim fails and lets the member go
    refill = pools.fill(target, policy, None)
    assert pools.release(taken.lease_id, "run-1", "not resumable", utcnow(), None)
    # then the fill left the claimed member its place: never more than max_size members
    assert refill.lease_ids == []
    counts = pools.member_counts(["py"])["py"]
    assert sum(counts.values()) == 3, counts
    assert counts[LeaseState.PENDING_CLEANUP] == 1 and counts[LeaseState.WARM] == 2
