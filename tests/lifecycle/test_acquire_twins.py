"""Two copies of one run's acquire, sent at once with different specs whose sandbox keys
differ (another thread, tenant or reuse), both read the run before either bound it: the
copy that binds second must not bind the run to a second sandbox. Every bind of a run
(a new intent, a reuse, a pool claim) is a compare-and-set on the run's lease; the copy
that loses writes nothing and answers as a repeated acquire does (tasks/same_spec.py).
On SQLite and PostgreSQL, over real local sandboxes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from models.invariants import check
from models.pool_store import ClaimIntent, PoolStore
from models.schema import LeaseState, RunStatus, utcnow
from models.store import NewLease, RunRebound, Store
from providers.errors import InvalidRequest
from providers.spec import SandboxSpec
from tasks.acquire import AcquireResult, acquire_lease
from tasks.leases import new_lease_id
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(120)


class TwinStore(Store):
    """Runs ``meanwhile`` once, just before this copy's first intent or bind: the twin's
    whole acquire landing between this copy's read of the run and its bind."""

    def __init__(self, url: str, meanwhile: Callable[[], Any]) -> None:
        super().__init__(url)
        self.meanwhile: Callable[[], Any] | None = meanwhile

    def _twin(self) -> None:
        if self.meanwhile is not None:
            act, self.meanwhile = self.meanwhile, None
            act()

    def create_intent(self, new: NewLease, task_id: str | None,
                      bound_lease: str | None = None) -> Any:
        self._twin()
        return super().create_intent(new, task_id, bound_lease)

    def bind_run(self, run_id: str, lease_id: str, sandbox_key: str,
                 bound_lease: str | None = None) -> None:
        self._twin()
        super().bind_run(run_id, lease_id, sandbox_key, bound_lease)


def racing(rt: Runtime, meanwhile: Callable[[], Any]) -> Runtime:
    return Runtime(settings=rt.settings, store=TwinStore(rt.store.url, meanwhile),
                   _providers=rt._providers)


def no_violations(rt: Runtime) -> None:
    assert [v.describe() for v in check(rt.store, utcnow(), 0, leaseless_grace_s=3600)] == []


MINE = SandboxSpec(thread_id="th-1", reuse=True, env={"MODE": "mine"})


@pytest.mark.parametrize(("twins", "fields"), [
    (SandboxSpec(thread_id="th-2", reuse=True), "thread_id"),
    (SandboxSpec(thread_id="th-1", tenant="acme", reuse=True), "tenant"),
    (SandboxSpec(thread_id="th-1"), "reuse"),
], ids=["other-thread", "other-tenant", "not-reused"])
def test_a_twin_with_another_spec_that_binds_first_leaves_the_run_one_sandbox(
    rt: Runtime, twins: SandboxSpec, fields: str
) -> None:
    won: list[str] = []
    mine = racing(rt, lambda: won.append(acquire_lease(rt, "run-1", twins, None,
                                                       False).lease_id))
    try:
        with pytest.raises(InvalidRequest) as refused:
            acquire_lease(mine, "run-1", MINE, None, may_retry=False)
    finally:
        mine.store.dispose()
    assert f"run run-1 already has lease {won[0]} (active)" in str(refused.value)
    assert f"differing fields: {fields}" in str(refused.value)
    # the run holds the twin's sandbox, the only one: nothing of this copy was written
    (lease,) = rt.store.leases()
    run = rt.store.get_run("run-1")
    assert run is not None and (run.status, run.lease_id) == (RunStatus.RUNNING, won[0])
    assert (lease.lease_id, lease.state, lease.run_id) == (won[0], LeaseState.ACTIVE, "run-1")
    assert [r.name for r in rt.provider("local").list_managed()] == [lease.provider_lease_id]
    no_violations(rt)


def test_a_twin_that_reused_the_threads_sandbox_first_is_answered_already_acquired(
    rt: Runtime,
) -> None:
    # The thread's sandbox is live; both copies reuse it: binding the same lease twice is
    # no conflict, and the copy that binds second answers as the first did.
    shared = acquire_lease(rt, "run-0", MINE, None, False).lease_id
    won: list[str] = []
    mine = racing(rt, lambda: won.append(acquire_lease(rt, "run-1", MINE, None,
                                                       False).lease_id))
    try:
        again = acquire_lease(mine, "run-1", MINE, None, may_retry=False)
    finally:
        mine.store.dispose()
    assert won == [shared] and again.lease_id == shared
    assert again.result == AcquireResult.REUSED
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id == shared and len(rt.store.leases()) == 1
    no_violations(rt)


def test_a_bind_after_the_run_was_bound_elsewhere_writes_nothing(rt: Runtime) -> None:
    first = acquire_lease(rt, "run-1", SandboxSpec(thread_id="th-1", reuse=True), None,
                          False).lease_id
    other = acquire_lease(rt, "run-0", SandboxSpec(thread_id="th-2", reuse=True), None,
                          False).lease_id
    with pytest.raises(RunRebound, match=f"run run-1 was bound to lease {first} meanwhile"):
        rt.store.bind_run("run-1", other, "sk-other")  # read while the run had no lease
    assert rt.store.get_lease(other).run_id == "run-0"
    run = rt.store.get_run("run-1")
    assert run is not None and run.lease_id == first
    # the lease the acquire read (an ended one of the thread, say) may still be replaced
    rt.store.bind_run("run-1", other, "sk-other", bound_lease=first)
    assert rt.store.get_run("run-1").lease_id == other  # type: ignore[union-attr]


def test_a_pool_claim_after_the_run_was_bound_elsewhere_takes_no_member(
    rt: Runtime,
) -> None:
    bound = acquire_lease(rt, "run-1", SandboxSpec(thread_id="th-1", reuse=True), None,
                          False).lease_id
    member = new_lease_id()
    now = utcnow()
    rt.store.create_intent(NewLease(
        lease_id=member, sandbox_key=f"pool:py:{member}", provider="local",
        provider_lease_id=f"lk-{member}", reuse=False, tenant="default", thread_id=None,
        run_id=None, spec={}, acquire_deadline_at=now + timedelta(minutes=1),
        deadline_at=now + timedelta(hours=1), idle_timeout_s=60, pool="py"), None)
    assert rt.store.move(member, {LeaseState.PROVISIONING}, LeaseState.WARM, "ready", None)
    intent = ClaimIntent(pool="py", run_id="run-1", sandbox_key="sk-run-1",
                         tenant="default", thread_id=None, reuse=False, spec={},
                         acquire_deadline_at=now + timedelta(minutes=1),
                         deadline_at=now + timedelta(hours=1), idle_timeout_s=60)
    with pytest.raises(RunRebound, match=f"run run-1 was bound to lease {bound} meanwhile"):
        PoolStore(rt.store).claim(intent, None)
    kept = rt.store.get_lease(member)
    assert (kept.state, kept.run_id, kept.claimed_at) == (LeaseState.WARM, None, None)
    assert rt.store.get_run("run-1").lease_id == bound  # type: ignore[union-attr]
    # the run's lease as the acquire read it may be replaced: the claim takes the member
    taken = PoolStore(rt.store).claim(
        ClaimIntent(**{**intent.__dict__, "bound_lease": bound}), None)
    assert taken is not None and taken.lease_id == member
    assert rt.store.get_run("run-1").lease_id == member  # type: ignore[union-attr]
