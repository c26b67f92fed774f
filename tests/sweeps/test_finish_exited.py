"""sweep.finish_exited: a sandbox command that ended by itself finishes its run (completed
for 0, failed otherwise, exit code recorded) through run.finish's path; unknown never does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus
from providers.faulty import FaultPlan
from tasks.finish_exited import ExitedOutcome, finish_exited
from tasks.runs import finish
from tasks.sweeping import SweepContext
from tests.e2e.conftest import eventually, until_gone
from tests.stack import WorkerStack
from tests.sweeps.conftest import Recorder, acquire, concurrently, set_lease
from workers.app import app
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def exited(rt: Runtime, lease_id: str, provider: str = "local") -> int:
    """Wait for the provider to report the lease's exit code (the sentinel is written)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for r in rt.provider(provider).list_managed():
            if r.lease_id == lease_id and r.exit_code is not None:
                return r.exit_code
        time.sleep(0.05)
    raise AssertionError(f"no exit code reported for {lease_id}")


def test_exit_zero_completes_the_run_and_enqueues_its_reclaim(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-ok", command=["sh", "-c", "exit 0"])
    assert exited(rt, lease_id) == 0
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.COMPLETED] == 1 and tally[ExitedOutcome.RECLAIMS_ENQUEUED] == 1
    run = rt.store.get_run("run-ok")
    assert (run.status, run.exit_code, run.error) == (RunStatus.COMPLETED, 0, None)
    assert effects.reclaims == ["run-ok"]
    # Idempotent: the run is no longer running, so the next tick finds nothing to do.
    again = finish_exited(SweepContext(rt, effects))
    assert sum(again.counts.values()) == 0 and effects.reclaims == ["run-ok"]


def test_non_zero_exit_fails_the_run_with_its_code(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-bad", command=["sh", "-c", "exit 3"])
    assert exited(rt, lease_id) == 3
    assert finish_exited(SweepContext(rt, effects))[ExitedOutcome.FAILED] == 1
    run = rt.store.get_run("run-bad")
    assert run.status == RunStatus.FAILED and run.exit_code == 3
    assert run.error == "the sandbox command exited with code 3"
    # The reclaim it enqueued destroys the sandbox, as after run.finish.
    effects.inline = True
    effects.reclaim("run-bad")
    assert rt.store.get_run("run-bad").reclaim_outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert rt.provider("local").list_managed() == []


def test_the_exit_text_is_stored_even_when_the_runs_secret_marks_are_gone(
        rt: Runtime, effects: Recorder) -> None:
    # The acquire here leaves no secret marks (the task does; acquire_lease alone does not):
    # as after a Redis that lost them. A caller's error would be withheld then; the sweep's
    # own text holds only the exit code, and is stored.
    lease_id = acquire(rt, "run-marked", command=["sh", "-c", "exit 3"],
                       secret_env={"API_TOKEN": "a-secret-of-some-length"})
    assert exited(rt, lease_id) == 3
    assert finish_exited(SweepContext(rt, effects))[ExitedOutcome.FAILED] == 1
    run = rt.store.get_run("run-marked")
    assert (run.status, run.exit_code, run.error) == (
        RunStatus.FAILED, 3, "the sandbox command exited with code 3")


def test_a_killed_group_is_finished_as_killed_and_a_running_one_never(
        rt: Runtime, effects: Recorder) -> None:
    # Before: a group killed outright (no exit code written) was "unknown" and its run
    # stayed running until its lease's idle or absolute deadline, though the sandbox was
    # known to be gone (a QA pass: a warm member killed so stayed warm for an hour).
    running = acquire(rt, "run-running")  # the idle shell: still running
    killed = acquire(rt, "run-killed")
    ending = acquire(rt, "run-ending")  # killed while its lease is being destroyed
    pids = {lease: int(rt.store.get_lease(lease).provider_meta["pid"])
            for lease in (killed, ending)}
    set_lease(rt, ending, state=LeaseState.DESTROYING)
    for pid in pids.values():
        os.killpg(pid, signal.SIGKILL)
    until_gone(rt, "local", killed, "the killed group to die")
    until_gone(rt, "local", ending, "the other killed group to die")
    listed = {r.lease_id: r for r in rt.provider("local").list_managed()}
    assert listed[running].exit_reason is None and listed[running].exit_code is None
    assert listed[killed].exit_code is None
    assert listed[killed].exit_reason == f"process {pids[killed]} killed"
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.FAILED] == 1 and tally[ExitedOutcome.LEASE_ENDING] == 1
    assert rt.store.get_run("run-running").status == RunStatus.RUNNING
    run = rt.store.get_run("run-killed")
    assert (run.status, run.exit_code, run.error) == (
        RunStatus.FAILED, None, "the sandbox was stopped before its command exited "
        f"(process {pids[killed]} killed); no exit code")
    # the destroy killed it, most likely: the lease's end settles the run
    assert rt.store.get_run("run-ending").status == RunStatus.RUNNING


def test_a_reused_sandbox_outlives_its_run_as_after_run_finish(
    rt: Runtime, effects: Recorder
) -> None:
    lease_id = acquire(rt, "run-reused", command=["sh", "-c", "exit 0"], reuse=True,
                       thread_id="t-1")
    exited(rt, lease_id)
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.COMPLETED] == 1 and tally[ExitedOutcome.RECLAIMS_ENQUEUED] == 0
    assert rt.store.get_run("run-reused").reclaim_due is False and effects.reclaims == []


def test_provider_failing_to_list_is_reported_and_the_others_still_swept(
    rt: Runtime, effects: Recorder, faults: FaultPlan
) -> None:
    lease_id = acquire(rt, "run-local", command=["sh", "-c", "exit 0"])
    exited(rt, lease_id)
    faults.write({"list_managed": [{"fault": "transient", "times": 1}]})
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.LIST_FAILED] == 1 and tally[ExitedOutcome.COMPLETED] == 1
    assert any("faulty" in item and "injected" in item for item in tally.items)


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-dry", command=["sh", "-c", "exit 4"])
    exited(rt, lease_id)
    tally = finish_exited(SweepContext(rt, effects, dry_run=True))
    assert tally[ExitedOutcome.FAILED] == 1 and "failed run-dry (exit code 4)" in tally.items
    assert rt.store.get_run("run-dry").status == RunStatus.RUNNING and effects.reclaims == []


def test_overlapping_ticks_finish_each_run_once(rt: Runtime, effects: Recorder) -> None:
    leases = [acquire(rt, f"run-{i}", command=["sh", "-c", f"exit {i}"]) for i in range(4)]
    for lease_id in leases:
        exited(rt, lease_id)
    tallies = concurrently([lambda: finish_exited(SweepContext(rt, effects))] * 3)
    finished = sum(t[ExitedOutcome.COMPLETED] + t[ExitedOutcome.FAILED] for t in tallies)
    assert finished == 4
    assert sorted(effects.reclaims) == [f"run-{i}" for i in range(4)]  # each exactly once
    assert [rt.store.get_run(f"run-{i}").exit_code for i in range(4)] == [0, 1, 2, 3]


def test_through_the_worker_the_run_is_finished_and_its_sandbox_reclaimed(
    stack: WorkerStack,
) -> None:
    from tasks import producer

    run_id = f"run-exit-{time.monotonic_ns()}"
    lease_id = producer.acquire_lease(run_id, {"command": ["sh", "-c", "exit 5"]}).get(60)[
        "lease_id"]
    rt = stack.runtime()
    exited(rt, lease_id)
    summary = app.send_task("sweep.finish_exited").get(30)
    assert summary["sweep"] == "sweep.finish_exited" and summary["run"] == "ran"
    assert summary["failed"] >= 1 and f"failed {run_id} (exit code 5)" in summary["items"]
    run = eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                     what="the reclaim")
    assert run.status == RunStatus.FAILED and run.exit_code == 5
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert not [r for r in rt.provider("local").list_managed() if r.lease_id == lease_id]


def test_every_running_run_sharing_a_reused_sandbox_is_finished(
    rt: Runtime, effects: Recorder, tmp_path: Path
) -> None:
    # Before: only the lease's latest run (run-b) was finished; run-a, bound to the same
    # sandbox by the thread's reuse, stayed running after its sandbox's command exited.
    stop = tmp_path / "stop"
    command = ["sh", "-c", f'while [ ! -e "{stop}" ]; do sleep 0.05; done; exit 5']
    shared = acquire(rt, "run-a", command=command, reuse=True, thread_id="t-1")
    assert acquire(rt, "run-b", command=command, reuse=True, thread_id="t-1") == shared
    done = acquire(rt, "run-c", command=command, reuse=True, thread_id="t-1")
    assert done == shared
    finish(rt, "run-c", RunStatus.COMPLETED, 0, None)  # finished before: left as it is
    stop.touch()
    assert exited(rt, shared) == 5
    tally = finish_exited(SweepContext(rt, effects))
    assert tally[ExitedOutcome.FAILED] == 2
    for run_id in ("run-a", "run-b"):
        run = rt.store.get_run(run_id)
        assert (run.status, run.exit_code, run.error, run.lease_id) == (
            RunStatus.FAILED, 5, "the sandbox command exited with code 5", shared)
        assert run.reclaim_due is False  # a reused sandbox outlives its runs (run.finish)
    run_c = rt.store.get_run("run-c")
    assert (run_c.status, run_c.exit_code) == (RunStatus.COMPLETED, 0)
    assert effects.reclaims == []
    again = finish_exited(SweepContext(rt, effects))
    assert sum(again.counts.values()) == 0


def test_runs_sharing_a_sandbox_past_the_batch_are_deferred_to_the_next_tick(
    runtime_with: Callable[..., Runtime], tmp_path: Path
) -> None:
    rt = runtime_with(sweep_batch_size=1)
    effects = Recorder(rt)
    stop = tmp_path / "stop"
    command = ["sh", "-c", f'while [ ! -e "{stop}" ]; do sleep 0.05; done; exit 0']
    shared = acquire(rt, "run-a", command=command, reuse=True, thread_id="t-1")
    assert acquire(rt, "run-b", command=command, reuse=True, thread_id="t-1") == shared
    stop.touch()
    exited(rt, shared)
    first = finish_exited(SweepContext(rt, effects))
    assert (first[ExitedOutcome.COMPLETED], first[ExitedOutcome.DEFERRED]) == (1, 1)
    second = finish_exited(SweepContext(rt, effects))
    assert (second[ExitedOutcome.COMPLETED], second[ExitedOutcome.DEFERRED]) == (1, 0)
    assert {rt.store.get_run(r).status for r in ("run-a", "run-b")} == {RunStatus.COMPLETED}
