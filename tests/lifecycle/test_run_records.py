"""Run records in odd orders, on SQLite and PostgreSQL with real local sandboxes: what
run.finish stores of a caller's error (no secret, bounded, storable), a finish that lands
while the run's reused sandbox is being bound, finishes repeated with other statuses,
detach/attach/touch after the end, and reuse threads finished in any order. After each,
the run and lease records tell the truth and ``leasekeeper check`` finds nothing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from models.invariants import check
from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from models.store import RunChange, Store
from providers.errors import (
    InvalidRequest,
    NotFound,
    RunNotRecorded,
    TransientProviderError,
    is_transient,
)
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.destroy import destroy_lease
from tasks.reclaim import reclaim_run
from tasks.redaction import remember
from tasks.runs import ERROR_MAX_CHARS, finish, parse_finish
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(120)


def acquire(rt: Runtime, run_id: str, **spec: Any) -> str:
    return acquire_lease(rt, run_id, SandboxSpec.model_validate(spec), None, False).lease_id


def no_violations(rt: Runtime) -> None:
    found = check(rt.store, utcnow(), 0, leaseless_grace_s=3600)
    assert [v.describe() for v in found] == []


# -- the error a caller sends ----------------------------------------------------------
def test_a_known_secret_in_a_finish_error_is_not_stored(rt: Runtime) -> None:
    secret = "tok-" + uuid.uuid4().hex
    remember([secret])  # as the worker does for every secret_env value it handles
    acquire(rt, "run-1")
    finish(rt, "run-1", RunStatus.FAILED, 1, f"login failed with {secret} (HTTP 401)")
    run = rt.store.get_run("run-1")
    assert run.error is not None and secret not in run.error
    assert run.error == "login failed with *** (HTTP 401)"


def test_a_secret_env_dump_in_a_finish_error_is_withheld(rt: Runtime) -> None:
    acquire(rt, "run-1")
    unknown = "never-seen-" + uuid.uuid4().hex  # no process has handled it: by shape only
    finish(rt, "run-1", RunStatus.FAILED, 2,
           f"crash\nspec: {{'secret_env': {{'TOKEN': '{unknown}'}}}}\nexit 2")
    error = rt.store.get_run("run-1").error or ""
    assert unknown not in error and error.startswith("crash\n") and error.endswith("exit 2")


def test_a_secret_across_the_length_bound_leaves_no_part_of_itself(rt: Runtime) -> None:
    secret = "S" + uuid.uuid4().hex * 2
    remember([secret])
    acquire(rt, "run-1")
    # the cut falls inside the secret: cut first, and its head would survive the scrub
    text = "x" * (ERROR_MAX_CHARS - 10) + secret + " and more"
    finish(rt, "run-1", RunStatus.FAILED, 1, text)
    error = rt.store.get_run("run-1").error or ""
    assert secret[:10] not in error and len(error) <= ERROR_MAX_CHARS
    assert error.startswith("x" * 100) and error.endswith("characters; the rest cut]")


@pytest.mark.parametrize(("sent", "stored"), ids=["nul", "lone-surrogate"], argvalues=[
    # PostgreSQL text cannot hold NUL: the finish failed there (StoreError), leaving the
    # run running, while SQLite stored it
    ("segfault\x00 in\x07 worker\n\tat line 3", "segfault\ufffd in\ufffd worker\n\tat line 3"),
    # what JSON's "\ud800" decodes to: no store can encode it (UnicodeEncodeError)
    ("bad \ud800 text", "bad \ufffd text"),
])
def test_an_error_no_store_can_hold_is_stored_readably(rt: Runtime, sent: str,
                                                       stored: str) -> None:
    acquire(rt, "run-1")
    change, due = finish(rt, "run-1", RunStatus.FAILED, 139, sent)
    assert change == RunChange.CHANGED and due
    run = rt.store.get_run("run-1")
    assert (run.status, run.exit_code, run.error) == (RunStatus.FAILED, 139, stored)


@pytest.mark.parametrize(("fields", "says"), [
    ({"status": "done"}, "status must be one of aborted, completed, failed, interrupted"),
    ({"status": None}, "status must be one of"),
    ({"exit_code": "0"}, "exit_code must be an integer"),
    ({"exit_code": True}, "exit_code must be an integer"),
    ({"exit_code": 2**31}, "exit_code must be an integer"),
    ({"exit_code": 1.0}, "exit_code must be an integer"),
    ({"error": 5}, "error must be a string or null"),
    ({"error": ["x"]}, "error must be a string or null"),
    ({"run_id": ""}, "run_id"),
    ({"run_id": 7}, "run_id"),
])
def test_malformed_finish_payloads_are_refused_and_change_nothing(
        rt: Runtime, fields: dict[str, Any], says: str) -> None:
    acquire(rt, "run-1")
    payload: dict[str, Any] = {"run_id": "run-1", "status": "completed", "exit_code": 0,
                               "error": None, **fields}
    with pytest.raises(InvalidRequest, match=r"invalid run\.finish payload") as err:
        parse_finish(**payload)
    assert says in str(err.value)
    run = rt.store.get_run("run-1")
    assert (run.status, run.exit_code, run.error, run.finished_at) == (
        RunStatus.RUNNING, None, None, None)


# -- finishing in odd orders -------------------------------------------------------------
def test_a_second_finish_with_another_status_changes_nothing(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    assert finish(rt, "run-1", RunStatus.COMPLETED, 0, None) == (RunChange.CHANGED, True)
    first = rt.store.get_run("run-1")
    assert finish(rt, "run-1", RunStatus.FAILED, 3, "late") == (RunChange.UNCHANGED, False)
    assert finish(rt, "run-1", RunStatus.INTERRUPTED, None, None) == (RunChange.UNCHANGED,
                                                                      False)
    run = rt.store.get_run("run-1")
    assert (run.status, run.exit_code, run.error, run.finished_at) == (
        RunStatus.COMPLETED, 0, None, first.finished_at)
    assert reclaim_run(rt, "run-1", None).outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    no_violations(rt)


def test_an_interrupted_run_finishes_later_and_only_then_is_reclaimed(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    assert finish(rt, "run-1", RunStatus.INTERRUPTED, None, "paused") == (RunChange.CHANGED,
                                                                          False)
    paused = rt.store.get_run("run-1")
    assert (paused.status, paused.finished_at, paused.reclaim_due) == (
        RunStatus.INTERRUPTED, None, False)
    with pytest.raises(InvalidRequest, match="finish it"):
        reclaim_run(rt, "run-1", None)
    assert finish(rt, "run-1", RunStatus.ABORTED, None, None) == (RunChange.CHANGED, True)
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.ABORTED and run.finished_at is not None
    assert run.error is None  # the pause's note is not the abort's reason
    assert reclaim_run(rt, "run-1", None).outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    no_violations(rt)


def test_a_finish_of_an_unknown_run_says_to_acquire_first(rt: Runtime) -> None:
    # RunNotRecorded is transient: the task retries it until its acquire records the run
    with pytest.raises(RunNotRecorded, match="no run 'ghost' yet; acquire a lease for it first"):
        finish(rt, "ghost", RunStatus.COMPLETED, 0, None)
    assert is_transient(RunNotRecorded("x"))
    assert rt.store.get_run("ghost") is None


def test_detach_and_attach_after_the_end_change_nothing(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    assert rt.store.set_detached("run-1", detached=True) == RunChange.CHANGED
    destroy_lease(rt, lease_id, "requested", None)
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.ABORTED and run.error == f"its lease {lease_id} ended: " \
        "requested"
    assert rt.store.set_detached("run-1", detached=False) == RunChange.UNCHANGED
    assert rt.store.set_detached("run-1", detached=True) == RunChange.UNCHANGED
    acquire(rt, "run-2")
    finish(rt, "run-2", RunStatus.COMPLETED, 0, None)
    assert rt.store.set_detached("run-2", detached=True) == RunChange.UNCHANGED
    assert rt.store.get_run("run-2").detached_since is None
    with pytest.raises(NotFound, match="no run 'ghost'"):
        rt.store.set_detached("ghost", detached=True)


def test_touch_of_an_ended_lease_moves_nothing_and_records_nothing(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    destroy_lease(rt, lease_id, "requested", None)
    before = rt.store.get_lease(lease_id)
    events = len(rt.store.events(lease_id))
    assert rt.store.touch(lease_id) is None
    after = rt.store.get_lease(lease_id)
    assert (after.state, after.idle_deadline_at, after.updated_at) == (
        LeaseState.DESTROYED, before.idle_deadline_at, before.updated_at)
    assert len(rt.store.events(lease_id)) == events
    with pytest.raises(NotFound, match="no lease 'nope'"):
        rt.store.touch("nope")


def test_reclaim_of_a_run_that_never_got_a_lease(rt: Runtime) -> None:
    held = acquire(rt, "run-1", sandbox_key="taken")
    with pytest.raises(InvalidRequest, match="already has a live lease"):
        acquire(rt, "run-2", sandbox_key="taken")
    rt.store.fail_leaseless_run("run-2", "acquire failed: key taken")  # as its task does
    done = reclaim_run(rt, "run-2", None)
    assert (done.outcome, done.lease_id, done.detail) == (
        ReclaimOutcome.NOT_FOUND, None, "the run has no lease")
    run = rt.store.get_run("run-2")
    assert run.reclaim_outcome == ReclaimOutcome.NOT_FOUND and run.lease_id is None
    assert rt.store.get_lease(held).state == LeaseState.ACTIVE  # the holder is untouched
    with pytest.raises(NotFound, match="no run 'ghost'"):
        reclaim_run(rt, "ghost", None)


# -- reuse threads -----------------------------------------------------------------------
@pytest.mark.parametrize("order", [("run-1", "run-2"), ("run-2", "run-1")])
def test_a_reused_sandbox_outlives_its_runs_in_either_order(rt: Runtime,
                                                             order: tuple[str, str]) -> None:
    spec = {"thread_id": "th", "reuse": True}
    lease_id = acquire(rt, "run-1", **spec)
    assert acquire(rt, "run-2", **spec) == lease_id
    for run_id in order:
        assert finish(rt, run_id, RunStatus.COMPLETED, 0, None) == (RunChange.CHANGED, False)
        assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE
    no_violations(rt)
    assert acquire(rt, "run-3", **spec) == lease_id  # still the thread's
    for run_id in order:  # a reclaim by hand leaves it to the run still using it
        done = reclaim_run(rt, run_id, None)
        assert (done.outcome, done.detail) == (ReclaimOutcome.NOT_FOUND,
                                               "sandbox still serves run run-3")
    destroy_lease(rt, lease_id, "idle", None)
    run3 = rt.store.get_run("run-3")
    assert run3.status == RunStatus.ABORTED and lease_id in (run3.error or "")
    assert [rt.store.get_run(r).status for r in order] == [RunStatus.COMPLETED] * 2
    no_violations(rt)


class FinishingStore(Store):
    """Runs ``meanwhile`` once, just before the first bind of a run to a reused lease:
    the web backend's run.finish landing while the acquire resume-checks the sandbox."""

    def __init__(self, url: str, meanwhile: Callable[[], Any]) -> None:
        super().__init__(url)
        self.meanwhile: Callable[[], Any] | None = meanwhile

    def bind_run(self, run_id: str, lease_id: str, sandbox_key: str,
                 bound_lease: str | None = None) -> None:
        if self.meanwhile is not None:
            act, self.meanwhile = self.meanwhile, None
            act()
        super().bind_run(run_id, lease_id, sandbox_key, bound_lease)


def test_a_run_finished_before_its_reuse_acquire_binds_is_not_bound(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th", reuse=True)
    lease_id = acquire_lease(rt, "run-1", spec, None, False).lease_id
    racing = Runtime(settings=rt.settings, store=FinishingStore(
        rt.store.url, lambda: finish(rt, "run-2", RunStatus.ABORTED, None, "user cancelled")),
        _providers=rt._providers)
    try:
        with pytest.raises(InvalidRequest, match="run run-2 is aborted; start a new run"):
            acquire_lease(racing, "run-2", spec, None, False)
    finally:
        racing.store.dispose()
    run2 = rt.store.get_run("run-2")
    assert (run2.status, run2.lease_id, run2.error) == (RunStatus.ABORTED, None,
                                                        "user cancelled")
    lease = rt.store.get_lease(lease_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, "run-1")  # still run-1's
    assert reclaim_run(rt, "run-2", None).outcome == ReclaimOutcome.NOT_FOUND
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE
    no_violations(rt)


def test_a_reused_lease_that_ends_before_the_bind_is_not_handed_out(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th", reuse=True)
    lease_id = acquire_lease(rt, "run-1", spec, None, False).lease_id
    racing = Runtime(settings=rt.settings, store=FinishingStore(
        rt.store.url, lambda: destroy_lease(rt, lease_id, "idle", None)),
        _providers=rt._providers)
    try:
        with pytest.raises(TransientProviderError, match=f"lease {lease_id} ended while run "
                           "run-2 was being bound to it; retrying"):
            acquire_lease(racing, "run-2", spec, None, True)
    finally:
        racing.store.dispose()
    ended = rt.store.get_lease(lease_id)
    assert (ended.state, ended.run_id) == (LeaseState.DESTROYED, "run-1")
    run2 = rt.store.get_run("run-2")
    assert (run2.status, run2.lease_id) == (RunStatus.RUNNING, None)
    no_violations(rt)
    fresh = acquire_lease(rt, "run-2", spec, None, True)  # the task's retry
    assert fresh.lease_id != lease_id and rt.store.get_run("run-2").lease_id == fresh.lease_id
    assert rt.store.get_run("run-1").status == RunStatus.ABORTED
    no_violations(rt)
