"""A resume check (or a reuse's check) that finds the sandbox command exited records the
lease's runs as sweep.finish_exited does: ``failed`` (``completed`` for 0) with the exit
code and "the sandbox command exited with code N", in the transaction that takes the
lease out of active. On SQLite and PostgreSQL, over real local sandboxes.

Before: the check only marked the lease pending_cleanup, and its destroy then aborted the
run ("its lease ... ended: not_resumable", no exit code), while the sweep, had it come
first, recorded the exit: the run's record depended on who noticed first (a QA pass)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, cast

import pytest

from models.invariants import check
from models.schema import LeaseState, RunStatus, utcnow
from providers.base import ResumeOutcome
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.destroy import destroy_lease
from tasks.finish_exited import ExitedOutcome, finish_exited
from tasks.reclaim import reclaim_run
from tasks.resume import check_lease
from tasks.sweeping import Effects, SweepContext
from tests.e2e.conftest import eventually, until_gone
from tests.stack import WorkerStack
from tests.sweeps.conftest import Recorder
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(120)

CRASHED = (RunStatus.FAILED, 3, "the sandbox command exited with code 3")


def acquire(rt: Runtime, run_id: str = "run-1", **spec: Any) -> str:
    return acquire_lease(rt, run_id, SandboxSpec.model_validate(spec), None, False).lease_id


def record(rt: Runtime, run_id: str = "run-1") -> tuple[str, int | None, str | None]:
    run = rt.store.get_run(run_id)
    assert run is not None
    return run.status, run.exit_code, run.error


def no_violations(rt: Runtime) -> None:
    found = check(rt.store, utcnow(), 0, leaseless_grace_s=3600)
    assert [v.describe() for v in found] == []


@pytest.mark.parametrize(("code", "expected"), ids=["exit-3", "exit-0"], argvalues=[
    (3, CRASHED), (0, (RunStatus.COMPLETED, 0, None))])
def test_a_resume_check_that_finds_the_command_exited_records_its_exit(
    rt: Runtime, code: int, expected: tuple[str, int, str | None],
) -> None:
    lease_id = acquire(rt, command=["sh", "-c", f"exit {code}"])
    until_gone(rt, "local", lease_id, "the command to exit")
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.NOT_RESUMABLE and checked.destroy_enqueued
    assert checked.reason.endswith(f"exited with exit code {code}")
    lease = rt.store.get_lease(lease_id)
    assert (lease.state, lease.end_reason) == (LeaseState.PENDING_CLEANUP, "not_resumable")
    assert record(rt) == expected  # with the lease's move, not at its destroy
    # the destroy the check enqueued ends the lease; the run keeps what it was told
    assert destroy_lease(rt, lease_id, checked.destroy_reason, None).state == "destroyed"
    assert record(rt) == expected
    assert rt.provider("local").list_managed() == []
    no_violations(rt)


@pytest.mark.parametrize("first", ["resume_check", "sweep"])
def test_the_record_of_a_crashed_run_does_not_depend_on_who_notices_first(
    rt: Runtime, first: str,
) -> None:
    effects = Recorder(rt)
    lease_id = acquire(rt, command=["sh", "-c", "exit 3"])
    until_gone(rt, "local", lease_id, "the command to exit")
    if first == "sweep":
        assert finish_exited(SweepContext(rt, cast(Effects, effects)))[ExitedOutcome.FAILED] == 1
        checked = check_lease(rt, lease_id, None)  # the run is finished: left as it is
    else:
        checked = check_lease(rt, lease_id, None)
        # the sweep's tick after it: the run is finished, nothing to do, nothing reclaimed
        tally = finish_exited(SweepContext(rt, cast(Effects, effects)))
        assert tally[ExitedOutcome.FAILED] == 0 and effects.reclaims == []
    assert checked.destroy_enqueued
    assert record(rt) == CRASHED
    destroy_lease(rt, lease_id, checked.destroy_reason, None)
    for run_id in effects.reclaims:
        reclaim_run(rt, run_id, None)
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert record(rt) == CRASHED
    no_violations(rt)


def test_every_unfinished_run_on_a_reused_sandbox_gets_its_exit(rt: Runtime) -> None:
    # a thread's runs reuse one sandbox: each still running (or paused) is bound to it
    spec = {"thread_id": "th", "reuse": True, "command": ["sh", "-c", "sleep 1; exit 3"]}
    lease_id = acquire(rt, "run-1", **spec)
    assert acquire(rt, "run-2", **spec) == lease_id
    rt.store.finish_run("run-2", RunStatus.INTERRUPTED, None, None, False, None)
    until_gone(rt, "local", lease_id, "the command to exit")
    assert check_lease(rt, lease_id, None).destroy_enqueued
    assert record(rt, "run-1") == record(rt, "run-2") == CRASHED


def test_a_reuse_that_finds_the_sandbox_exited_records_the_earlier_run_exit(
    rt: Runtime,
) -> None:
    spec = {"thread_id": "th", "reuse": True, "command": ["sh", "-c", "exit 3"]}
    old = acquire(rt, "run-1", **spec)
    until_gone(rt, "local", old, "the command to exit")
    fresh = acquire(rt, "run-2", **spec)  # run-1 still says running: its sandbox is gone
    assert fresh != old
    ended = rt.store.get_lease(old)
    assert (ended.state, ended.end_reason) == (LeaseState.DESTROYED, "not_resumable")
    assert record(rt, "run-1") == CRASHED
    assert record(rt, "run-2")[0] == RunStatus.RUNNING


def test_a_killed_process_group_fails_the_run_as_killed(rt: Runtime) -> None:
    # A group killed outright (SIGKILL, the OOM killer) writes no exit code. Before, the
    # check left the run running until the lease's end aborted it, while the sandbox was
    # known to be gone (and a warm member killed so stayed warm: a QA pass); now the check
    # and sweep.finish_exited both record it as stopped, killed, with no exit code.
    lease_id = acquire(rt)
    pid = int(rt.store.get_lease(lease_id).provider_meta["pid"])
    os.killpg(pid, signal.SIGKILL)
    until_gone(rt, "local", lease_id, "the process to die")  # no sentinel written
    checked = check_lease(rt, lease_id, None)
    assert checked.outcome == ResumeOutcome.NOT_RESUMABLE
    assert record(rt) == (RunStatus.FAILED, None, "the sandbox was stopped before its "
                          f"command exited (process {pid} killed); no exit code")
    destroy_lease(rt, lease_id, checked.destroy_reason, None)
    assert record(rt)[0] == RunStatus.FAILED  # the lease's end does not change it


def test_through_the_worker_a_resume_check_records_the_crash(stack: WorkerStack) -> None:
    from tasks import producer

    run_id = f"crash-{time.monotonic_ns()}"
    lease_id = producer.acquire_lease(
        run_id, {"command": ["sh", "-c", "sleep 1; exit 3"]}).get(60)["lease_id"]
    rt = stack.runtime()
    until_gone(rt, "local", lease_id, "the command to exit")
    answer = producer.check_resumable(lease_id).get(60)
    assert not answer["resumable"] and answer["reason"].endswith("exited with exit code 3")
    eventually(lambda: rt.store.get_lease(lease_id).state == LeaseState.DESTROYED,
               what="the destroy the check enqueued")
    assert record(rt, run_id) == CRASHED
