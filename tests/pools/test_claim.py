"""lease.acquire with ``spec.pool`` over a real store (SQLite and PostgreSQL) and real local
sandboxes: a claim answers ``claimed`` and the sandbox sees exactly its run's env and
secret; two claims never get the same member; a member that is not resumable is destroyed
and the next one (or a cold start) serves the run; a claimed member expires by the run's
TTL (agent-sandbox #587) and idle timeout; a redelivered claim and a worker killed
mid-claim; a member serves one run only."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.errors import InvalidRequest, TerminalProviderError, TransientProviderError
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tests.e2e.conftest import eventually
from tests.pools.conftest import (
    WAITING_MEMBER,
    PoolRecorder,
    fill,
    members,
    pool,
    sandboxes,
    warm,
)
from tests.sweeps.conftest import concurrently, set_lease
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def acquire(rt: Runtime, run_id: str, **spec: Any) -> Any:
    from tasks.acquire import acquire_lease

    return acquire_lease(rt, run_id, SandboxSpec.model_validate({"pool": "py", **spec}),
                         None, False)


@pytest.fixture
def waiting(runtime_with: Callable[..., Runtime]) -> Runtime:
    """A pool of two members that wait for their claim and record the env they get."""
    rt = runtime_with(pools=[pool(size=2, template={"command": WAITING_MEMBER,
                                                    "env": {"FROM_TEMPLATE": "t"}})])
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    assert len(warm(rt)) == 2
    return rt


def seen_env(rt: Runtime, lease_id: str) -> dict[str, str]:
    """What the sandbox itself read from its run directory (WAITING_MEMBER writes it)."""
    workspace = Path(rt.store.get_lease(lease_id).provider_meta["workspace"])
    seen = workspace / "work" / "seen.env"
    eventually(lambda: seen.exists() and seen.read_text().endswith("\n"), 30,
               "the sandbox to read its run's env")
    return dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)


def test_a_claim_gives_the_run_a_warm_member_and_only_its_own_data(waiting: Runtime) -> None:
    from tasks.acquire import AcquireResult

    rt = waiting
    secret = "s3cr3t 'quoted' $HOME `x`"
    done = acquire(rt, "run-1", tenant="acme", thread_id="th-1", env={"A": "1"},
                   secret_env={"API_TOKEN": secret}, labels={"team": "ml"}, ttl_s=600)
    assert done.result == AcquireResult.CLAIMED and done.backend == "process"
    lease = rt.store.get_lease(done.lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.pool == "py"
    assert (lease.run_id, lease.tenant, lease.thread_id) == ("run-1", "acme", "th-1")
    assert lease.claimed_at is not None and lease.idle_deadline_at is not None
    assert lease.spec["secret_env"] == {"API_TOKEN": "***"}
    assert lease.spec["env"] == {"FROM_TEMPLATE": "t", "A": "1"}
    assert lease.spec["labels"] == {"team": "ml"} and lease.spec["command"] == WAITING_MEMBER
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id == done.lease_id and run.sandbox_key == done.sandbox_key
    # the sandbox read exactly its run's env and secret, quotes and all
    env = seen_env(rt, done.lease_id)
    assert env["API_TOKEN"] == secret and env["A"] == "1" and env["FROM_TEMPLATE"] == "t"
    run_dir = Path(lease.provider_meta["run_dir"])
    assert (run_dir / "env").stat().st_mode & 0o777 == 0o600
    assert (run_dir / "claimed").read_text().strip() == "run-1"
    assert '"tenant": "acme"' in (run_dir / "run.json").read_text()
    assert secret not in (run_dir / "run.json").read_text()
    # ...and the other member saw nothing
    (other,) = warm(rt)
    assert list((Path(other.provider_meta["workspace"]) / "run").iterdir()) == []
    assert [e.reason for e in rt.store.events(done.lease_id)][-2:] == [
        "claimed from pool py by run run-1",
        "claimed from pool py by run run-1: its data delivered"]


def test_a_claimed_member_expires_by_the_runs_ttl_not_the_pools_max_age(
        runtime_with: Callable[..., Runtime]) -> None:
    """agent-sandbox #587: expiry missed sandboxes adopted from a pool."""
    from tasks.sweeping import SweepContext
    from tasks.sweeps import ExpireOutcome, expire_leases

    rt = runtime_with(pools=[pool(size=2, max_age_s=86400)])
    effects = PoolRecorder(rt, inline=True, inline_provision=True)
    fill(rt, effects)
    before = utcnow()
    ttl = acquire(rt, "run-ttl", ttl_s=60)
    idle = acquire(rt, "run-idle", idle_timeout_s=30)
    lease = rt.store.get_lease(ttl.lease_id)
    assert before + timedelta(seconds=59) < lease.deadline_at <= utcnow() + timedelta(seconds=60)
    idle_lease = rt.store.get_lease(idle.lease_id)
    assert idle_lease.idle_timeout_s == 30
    assert idle_lease.idle_deadline_at <= utcnow() + timedelta(seconds=30)
    set_lease(rt, ttl.lease_id, deadline_at=utcnow() - timedelta(seconds=1))
    set_lease(rt, idle.lease_id, idle_deadline_at=utcnow() - timedelta(seconds=1))
    tally = expire_leases(SweepContext(rt, effects))
    assert tally[ExpireOutcome.EXPIRED] == 1 and tally[ExpireOutcome.IDLE] == 1
    assert rt.store.get_lease(ttl.lease_id).end_reason == "expired"
    assert rt.store.get_lease(idle.lease_id).end_reason == "idle"
    assert {ttl.provider_lease_id, idle.provider_lease_id}.isdisjoint(sandboxes(rt))


def test_two_claims_at_once_never_get_the_same_member(waiting: Runtime) -> None:
    from tasks.acquire import AcquireResult

    rt = waiting
    results = concurrently([lambda i=i: acquire(rt, f"run-{i}", secret_env={"K": f"v-{i}"})
                            for i in range(4)])
    claimed = [r for r in results if r.result == AcquireResult.CLAIMED]
    cold = [r for r in results if r.result == AcquireResult.ACQUIRED]
    assert len(claimed) == 2 and len(cold) == 2
    assert len({r.lease_id for r in results}) == 4
    for result in claimed:  # each claimed sandbox got its own run's secret, no other
        run_index = result.run_id.removeprefix("run-")
        assert seen_env(rt, result.lease_id)["K"] == f"v-{run_index}"
        assert len(rt.store.events(result.lease_id)) == 4  # intent, warm, claimed, active
    for result in cold:
        lease = rt.store.get_lease(result.lease_id)
        assert lease.pool == "py" and lease.claimed_at is None  # asked the pool, got cold


def test_a_member_that_is_not_resumable_is_destroyed_and_the_next_serves_the_run(
        waiting: Runtime) -> None:
    from tasks.acquire import AcquireResult

    rt = waiting
    dead, alive = warm(rt)
    from tasks.leases import handle

    os.killpg(dead.provider_meta["pid"], signal.SIGKILL)
    eventually(lambda: rt.provider("local").resume_check(handle(dead), 1).outcome
               == "not_resumable", 10, "the member's process to die")
    done = acquire(rt, "run-1")
    assert done.result == AcquireResult.CLAIMED and done.lease_id == alive.lease_id
    gone = rt.store.get_lease(dead.lease_id)
    assert gone.state == LeaseState.DESTROYED and gone.end_reason == "not_resumable"
    assert gone.run_id is None  # let go: never the run's
    assert any("not resumable at its claim by run run-1" in e.reason
               for e in rt.store.events(dead.lease_id))
    assert dead.provider_lease_id not in sandboxes(rt)
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id == alive.lease_id and run.status == "running"


def test_when_no_member_is_resumable_the_run_starts_cold(waiting: Runtime) -> None:
    from tasks.acquire import AcquireResult

    rt = waiting
    from tasks.leases import handle

    for member in warm(rt):
        os.killpg(member.provider_meta["pid"], signal.SIGKILL)
    for member in warm(rt):
        eventually(lambda m=member: rt.provider("local").resume_check(handle(m), 1).outcome
                   == "not_resumable", 10, "the member to die")
    done = acquire(rt, "run-1", env={"A": "1"})
    assert done.result == AcquireResult.ACQUIRED
    lease = rt.store.get_lease(done.lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.pool == "py" and lease.claimed_at is None
    assert lease.spec["command"] == WAITING_MEMBER  # the same sandbox the pool would give
    assert all(m.state == LeaseState.DESTROYED for m in members(rt))


def test_an_empty_pool_means_a_cold_acquire(rt: Runtime) -> None:
    import json

    from tasks.acquire import AcquireResult

    done = acquire(rt, "run-1")
    assert done.result == AcquireResult.ACQUIRED
    lease = rt.store.get_lease(done.lease_id)
    assert lease.pool == "py" and lease.claimed_at is None and lease.run_id == "run-1"
    record = json.loads((Path(lease.provider_meta["workspace"]) / "lease.json").read_text())
    assert record["labels"]["leasekeeper.dev/pool"] == "py"
    assert members(rt) == []  # a cold lease of a run is not a member


def test_a_cold_start_from_a_pool_gets_its_runs_data_as_a_claimed_member_does(
        runtime_with: Callable[..., Runtime]) -> None:
    """The pool's template waits for its run's data (README "Warm pools"): a run that finds
    the pool empty gets the same sandbox and the same delivery, or it would wait forever."""
    import json

    from tasks.acquire import AcquireResult

    rt = runtime_with(pools=[pool(size=2, template={"command": WAITING_MEMBER,
                                                    "env": {"FROM_TEMPLATE": "t"}})])
    done = acquire(rt, "run-cold", env={"A": "1"}, secret_env={"API_TOKEN": "cold-s3cret"})
    assert done.result == AcquireResult.ACQUIRED
    env = seen_env(rt, done.lease_id)  # the template's command started, with the run's env
    assert (env["API_TOKEN"], env["A"], env["FROM_TEMPLATE"]) == ("cold-s3cret", "1", "t")
    lease = rt.store.get_lease(done.lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.claimed_at is None and lease.pool == "py"
    assert members(rt) == [] and "cold-s3cret" not in json.dumps(lease.provider_meta)


def test_a_cold_start_from_a_pool_stuck_before_its_delivery_is_destroyed_not_adopted(
        runtime_with: Callable[..., Runtime]) -> None:
    from tasks.acquire import acquire_lease
    from tasks.stuck import StuckOutcome, stuck_provisioning
    from tasks.sweeping import SweepContext

    # given a run's sandbox created cold from the pool, whose delivery failed (as when its
    # worker died between the two): healthy, provisioning, without the run's data
    rt = runtime_with(pools=[pool(provider="faulty", size=2,
                                  template={"command": WAITING_MEMBER})])
    FaultPlan(rt.settings.faults_file).write(  # type: ignore[arg-type]
        {"claim": [{"fault": "transient", "when": "before", "times": 1}]})
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", SandboxSpec(pool="py"), None, may_retry=True)
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id is not None
    lease = rt.store.get_lease(run.lease_id)
    assert lease.state == LeaseState.PROVISIONING and lease.provider_lease_id in sandboxes(
        rt, "faulty")
    # when sweep.stuck_provisioning finds it past its acquire deadline
    set_lease(rt, lease.lease_id, acquire_deadline_at=utcnow())
    tally = stuck_provisioning(SweepContext(rt, PoolRecorder(rt, inline=True)))
    # then it is destroyed, never adopted half-done, and its run failed
    assert tally[StuckOutcome.DESTROY_ENQUEUED] == 1, tally
    lease = rt.store.get_lease(lease.lease_id)
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_stuck"
    run = rt.store.get_run("run-1")
    assert run is not None and run.status == RunStatus.FAILED
    assert "from pool py's template did not complete" in (run.error or "")
    assert lease.provider_lease_id not in sandboxes(rt, "faulty")


def test_a_spec_must_not_ask_for_another_sandbox_than_the_pool_runs(
        runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(pools=[pool(template={"image": "python:3.12", "command": ["sleep",
                                                                                "3600"]})])
    for field, value in [("image", "python:3.13"), ("command", ["sh"]),
                         ("provider", "noop"), ("backend", "job"),
                         ("resources", {"cpu_limit": "1"})]:
        with pytest.raises(InvalidRequest, match=f"spec.{field} differs from pool 'py'"):
            acquire(rt, f"run-{field}", **{field: value})
    with pytest.raises(InvalidRequest, match="unknown pool 'go': this installation declares py"):
        acquire(rt, "run-unknown", pool="go")
    # the same values as the template, or none, are fine
    assert acquire(rt, "run-same", image="python:3.12", command=["sleep", "3600"]).lease_id
    assert rt.store.get_run("run-image") is None and rt.store.get_run("run-unknown") is None


def test_a_run_that_names_no_tenant_gets_the_templates(runtime_with: Callable[..., Runtime]
                                                       ) -> None:
    from workers.pool_settings import resolve_spec

    rt = runtime_with(pools=[pool(template={"tenant": "acme", "labels": {"a": "1"}})])
    plain = resolve_spec(rt.settings.pools, SandboxSpec(pool="py", labels={"b": "2"}))
    assert plain.tenant == "acme" and plain.labels == {"a": "1", "b": "2"}
    assert plain.provider == "local" and resolve_spec(rt.settings.pools, plain) == plain
    assert resolve_spec(rt.settings.pools, SandboxSpec(pool="py", tenant="zeta")).tenant == "zeta"


def test_a_redelivered_claim_delivers_again_and_activates(waiting: Runtime) -> None:
    from tasks import pool_claim
    from tasks.acquire import AcquireResult
    from tasks.leases import sandbox_key
    from workers.pool_settings import resolve_spec

    rt = waiting
    spec = resolve_spec(rt.settings.pools, SandboxSpec(pool="py", secret_env={"K": "v"}))
    rt.store.start_run("run-1", None, "local", sandbox_key(spec, "local", "run-1"))
    # a worker took the member for the run, then died before delivering
    member = pool_claim.take(rt, spec, sandbox_key(spec, "local", "run-1"), "run-1", None)
    assert member is not None and rt.store.get_lease(member.lease_id).state == "provisioning"
    done = acquire(rt, "run-1", secret_env={"K": "v"})  # the redelivery
    assert done.result == AcquireResult.CLAIMED and done.lease_id == member.lease_id
    assert seen_env(rt, member.lease_id)["K"] == "v"
    again = acquire(rt, "run-1", secret_env={"K": "v"})
    assert again.result == AcquireResult.ALREADY_ACQUIRED and again.lease_id == member.lease_id
    assert len(warm(rt)) == 1


def test_a_run_that_ended_before_its_claim_gets_no_member(waiting: Runtime) -> None:
    # The acquire read the run as running; it ended (run.finish, or sweep.reap_runs failed
    # it) before the claim: the claim must not bind a warm member to an ended run, whose
    # reclaim already found no lease to destroy (the member would sit active, unclaimed by
    # anyone, until its TTL).
    from tasks import pool_claim
    from tasks.leases import sandbox_key
    from workers.pool_settings import resolve_spec

    rt = waiting
    spec = resolve_spec(rt.settings.pools, SandboxSpec(pool="py"))
    key = sandbox_key(spec, "local", "run-1")
    rt.store.start_run("run-1", None, "local", key)
    rt.store.finish_run("run-1", RunStatus.COMPLETED, 0, None, True, None)
    with pytest.raises(InvalidRequest, match="run-1 is no longer running"):
        pool_claim.take(rt, spec, key, "run-1", None)
    assert len(warm(rt)) == 2  # both members still the pool's
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id is None and run.status == RunStatus.COMPLETED
    assert all(lease.run_id is None for lease in rt.store.leases())


def test_a_worker_killed_mid_claim_leaves_a_lease_stuck_provisioning_cleans_up(
        waiting: Runtime) -> None:
    from tasks import pool_claim
    from tasks.leases import sandbox_key
    from tasks.stuck import StuckOutcome, stuck_provisioning
    from tasks.sweeping import SweepContext
    from workers.pool_settings import resolve_spec

    rt = waiting
    spec = resolve_spec(rt.settings.pools, SandboxSpec(pool="py"))
    key = sandbox_key(spec, "local", "run-1")
    rt.store.start_run("run-1", None, "local", key)
    member = pool_claim.take(rt, spec, key, "run-1", None)
    assert member is not None
    set_lease(rt, member.lease_id, acquire_deadline_at=utcnow())
    effects = PoolRecorder(rt, inline=True)
    tally = stuck_provisioning(SweepContext(rt, effects))
    assert tally[StuckOutcome.DESTROY_ENQUEUED] == 1  # healthy, but never adopted half-done
    lease = rt.store.get_lease(member.lease_id)
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_stuck"
    run = rt.store.get_run("run-1")
    assert run is not None and run.status == RunStatus.FAILED
    assert "did not complete" in (run.error or "")
    assert member.provider_lease_id not in sandboxes(rt)


def test_claim_errors_retry_or_fail_the_run_like_an_acquire(
        runtime_with: Callable[..., Runtime]) -> None:
    from tasks.acquire import AcquireResult, acquire_lease

    rt = runtime_with(pools=[pool(provider="faulty", size=2)])
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    faults = FaultPlan(rt.settings.faults_file)  # type: ignore[arg-type]
    # a transient error after the delivery: the member stays the run's; the retry delivers
    faults.write({"claim": [{"fault": "transient", "when": "after", "times": 1}]})
    spec = SandboxSpec(pool="py", secret_env={"TOKEN": "hunter2-abcdef"})
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", spec, None, may_retry=True)
    held = rt.store.get_run("run-1").lease_id  # type: ignore[union-attr]
    assert rt.store.get_lease(held).state == LeaseState.PROVISIONING
    assert acquire_lease(rt, "run-1", spec, None, True).result == AcquireResult.CLAIMED
    assert rt.store.get_run("run-1").lease_id == held  # type: ignore[union-attr]
    # a terminal one: the failed-acquire path (the member destroyed, the run failed)
    faults.write({"claim": [{"fault": "terminal", "times": 1}]})
    with pytest.raises(TerminalProviderError) as failed:
        acquire_lease(rt, "run-2", spec, None, may_retry=True)
    assert "hunter2" not in str(failed.value)
    run = rt.store.get_run("run-2")
    assert run is not None and run.status == RunStatus.FAILED
    assert rt.store.get_lease(run.lease_id).state == LeaseState.DESTROYED  # type: ignore[arg-type]


def test_a_member_serves_one_run_and_is_destroyed_after_it(waiting: Runtime) -> None:
    from tasks.reclaim import reclaim_run
    from tasks.runs import finish

    rt = waiting
    done = acquire(rt, "run-1")
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)
    assert reclaim_run(rt, "run-1", None).outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(done.lease_id).state == LeaseState.DESTROYED
    assert done.provider_lease_id not in sandboxes(rt)
    second = acquire(rt, "run-2")
    assert second.lease_id != done.lease_id  # never handed out again


def test_with_reuse_the_threads_next_run_reuses_the_claimed_member(waiting: Runtime) -> None:
    from tasks.acquire import AcquireResult

    rt = waiting
    first = acquire(rt, "run-1", thread_id="th-1", reuse=True)
    second = acquire(rt, "run-2", thread_id="th-1", reuse=True)
    assert first.result == AcquireResult.CLAIMED and second.result == AcquireResult.REUSED
    assert second.lease_id == first.lease_id and len(warm(rt)) == 1


def test_no_secret_value_reaches_the_store(waiting: Runtime) -> None:
    from sqlalchemy import text

    rt = waiting
    secret = "never-stored-7f3a9c21"
    acquire(rt, "run-1", secret_env={"API_TOKEN": secret})
    with rt.store.engine.connect() as conn:
        dump = "\n".join(repr(tuple(row)) for table in (
            "leases", "runs", "lease_events", "pools", "provider_errors", "sweep_ticks")
            for row in conn.execute(text(f'SELECT * FROM "{table}"')))
    assert "API_TOKEN" in dump and secret not in dump


@pytest.mark.postgres
def test_on_postgres_a_claim_skips_a_member_another_transaction_holds(
        postgres_runtime: Runtime) -> None:
    """SKIP LOCKED: a member locked by another claim (or a drain) is passed over at once,
    not waited for; the claim takes the next one. (Row locks are PostgreSQL's: SQLite
    serialises whole write transactions.)"""
    import threading

    from sqlalchemy import select

    from models.schema import Lease

    rt = postgres_runtime
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    held, free = warm(rt)
    results: list[Any] = []
    with rt.store.engine.connect() as conn:
        tx = conn.begin()
        conn.execute(select(Lease.lease_id).where(Lease.lease_id == held.lease_id)
                     .with_for_update())
        claimer = threading.Thread(target=lambda: results.append(acquire(rt, "run-1")))
        claimer.start()
        claimer.join(30)
        finished = not claimer.is_alive()
        tx.rollback()
    claimer.join(30)
    assert finished, "the claim waited for the locked member instead of skipping it"
    assert results[0].lease_id == free.lease_id
    assert rt.store.get_lease(held.lease_id).state == LeaseState.WARM
