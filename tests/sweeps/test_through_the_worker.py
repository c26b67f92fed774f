"""The sweeps as Celery runs them: tasks on a real worker, their summaries (what Flower
shows as the task result), overlapping sends, two real beat processes, and the operator's
`leasekeeper reap [--dry-run]`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, select

from models.schema import Lease, LeaseEvent, LeaseState, Run, RunStatus, utcnow
from tasks import producer
from tests.e2e.conftest import eventually
from tests.stack import REPO, WorkerStack
from tests.sweeps.beats import beats
from tests.sweeps.conftest import events_to, set_lease
from workers.app import app
from workers.beat import SWEEPS as BEAT_SWEEPS
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(180)


def rid(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def acquire(spec: dict[str, Any] | None = None, run_id: str | None = None) -> tuple[str, str]:
    run_id = run_id or rid()
    return run_id, producer.acquire_lease(run_id, spec or {}).get(60)["lease_id"]


def forget_and_age(rt: Runtime, lease_id: str) -> None:
    """Delete the lease's rows behind the system's back; make its sandbox an hour old."""
    with rt.store.tx() as s:
        s.execute(delete(LeaseEvent).where(LeaseEvent.lease_id == lease_id))
        s.execute(delete(Run).where(Run.lease_id == lease_id))
        s.execute(delete(Lease).where(Lease.lease_id == lease_id))
    record = Path(rt.settings.effective_local_root) / f"lk-{lease_id}" / "lease.json"
    data = json.loads(record.read_text())
    old = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    record.write_text(json.dumps({**data, "created_at": old}))


def destroyed(rt: Runtime, lease_id: str) -> bool:
    lease = rt.store.find_lease(lease_id)
    return lease is not None and lease.state == LeaseState.DESTROYED


def test_every_beat_sweep_runs_on_the_worker_and_returns_its_summary(
    stack: WorkerStack,
) -> None:
    from tasks.reap import SWEEPS

    assert set(BEAT_SWEEPS) == set(SWEEPS)  # the schedule and `leasekeeper reap` agree
    for name in SWEEPS:
        summary = app.send_task(name).get(60)
        assert summary["sweep"] == name and summary["run"] in {"ran", "skipped"}
        assert isinstance(summary["took_ms"], int) and isinstance(summary.get("items", []), list)


def test_overlapping_sends_of_one_sweep_do_the_work_once(stack: WorkerStack) -> None:
    rt = stack.runtime()
    leases = [acquire()[1] for _ in range(4)]
    for lease_id in leases:
        set_lease(rt, lease_id, idle_deadline_at=utcnow())
    results = [app.send_task("sweep.expire_leases") for _ in range(4)]
    summaries = [r.get(60) for r in results]
    assert sum(s.get("idle", 0) for s in summaries) >= 4
    for lease_id in leases:
        eventually(lambda lid=lease_id: destroyed(rt, lid), 60, "the idle lease destroyed")
        assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "idle") == 1
        assert events_to(rt, lease_id, LeaseState.DESTROYING) == 1


def test_orphan_and_stuck_lease_are_reconciled_by_the_worker(stack: WorkerStack) -> None:
    rt = stack.runtime()
    _, orphan = acquire()
    pid = rt.store.get_lease(orphan).provider_meta["pid"]
    forget_and_age(rt, orphan)
    summary = app.send_task("sweep.orphans").get(60)
    assert f"recorded {orphan} (local lk-{orphan})" in summary["items"]
    eventually(lambda: destroyed(rt, orphan), 60, "the orphan destroyed")
    assert rt.store.get_lease(orphan).end_reason == "orphan"
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()

    # A lease whose acquire message died with its worker after the sandbox was made.
    run_id, stuck = acquire()
    assert rt.store.transition(stuck, {LeaseState.ACTIVE}, LeaseState.PROVISIONING, "as if",
                               acquire_deadline_at=utcnow())
    summary = app.send_task("sweep.stuck_provisioning").get(60)
    assert f"adopted {stuck}" in summary["items"]
    assert rt.store.get_lease(stuck).state == LeaseState.ACTIVE
    producer.finish_run(run_id, "completed", 0).get(30)
    eventually(lambda: destroyed(rt, stuck), 60, "the adopted lease reclaimed")


def test_two_beats_never_do_the_same_work_twice(stack: WorkerStack) -> None:
    rt = stack.runtime()
    idle = [acquire({"idle_timeout_s": 2})[1] for _ in range(6)]
    detached = [acquire() for _ in range(3)]
    for run_id, _ in detached:
        producer.detach_run(run_id).get(30)
    exited = [acquire({"command": ["sh", "-c", "exit 7"]}) for _ in range(3)]
    everything = idle + [lid for _, lid in detached + exited]
    with beats(stack.env, stack.root, 2, interval_s=1.0, tag=uuid.uuid4().hex[:6]) as logs:
        deadline = time.monotonic() + 120
        while not all(destroyed(rt, lid) for lid in everything):
            assert time.monotonic() < deadline, "the sweeps did not converge"
            time.sleep(0.2)
        time.sleep(2.5)  # a few more ticks from both beats: they must find nothing to redo
    for log in logs:  # both beats really were sending ticks
        assert log.read_text().count("Sending due task sweep.expire_leases") >= 3
    for lease_id in idle:
        assert events_to(rt, lease_id, LeaseState.PENDING_CLEANUP, "idle: past") == 1
    for lease_id in everything:
        assert events_to(rt, lease_id, LeaseState.DESTROYING) == 1
        assert events_to(rt, lease_id, LeaseState.DESTROYED) == 1
    for run_id, _ in detached:
        assert rt.store.get_run(run_id).status == RunStatus.ABORTED
    for run_id, _ in exited:
        run = rt.store.get_run(run_id)
        assert (run.status, run.exit_code, run.reclaim_outcome) == (RunStatus.FAILED, 7,
                                                                    "destroyed")


def snapshot(rt: Runtime) -> list[Any]:
    with rt.store.tx() as s:
        return [list(s.execute(select(*table.__table__.c)).all())  # type: ignore[attr-defined]
                for table in (Lease, Run, LeaseEvent)]


def reap(stack: WorkerStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**stack.env, "LEASEKEEPER_RUN_DETACH_TTL_S": "0"}
    return subprocess.run([sys.executable, "-m", "workers.cli", "reap", *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_reap_dry_run_changes_nothing_and_reap_acts_once(stack: WorkerStack) -> None:
    rt = stack.runtime()
    detached_run, detached_lease = acquire()
    producer.detach_run(detached_run).get(30)
    _, idle = acquire()
    set_lease(rt, idle, idle_deadline_at=utcnow())
    _, orphan = acquire()
    forget_and_age(rt, orphan)
    before, sandboxes = snapshot(rt), sorted(os.listdir(rt.settings.effective_local_root))

    dry = reap(stack, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would: aborted_detached {detached_run}" in dry.stdout
    assert f"would: idle {idle}" in dry.stdout
    assert f"would: recorded {orphan}" in dry.stdout
    assert "sweep.orphans (dry_run" in dry.stdout
    assert snapshot(rt) == before
    assert sorted(os.listdir(rt.settings.effective_local_root)) == sandboxes

    done = reap(stack)
    assert done.returncode == 0, done.stderr
    assert f"aborted_detached {detached_run}" in done.stdout and "would:" not in done.stdout
    for lease_id in (detached_lease, idle, orphan):
        eventually(lambda lid=lease_id: destroyed(rt, lid), 60, "the sweeps' destroys")
    again = reap(stack, "--dry-run", "--sweep", "sweep.reap_runs", "--sweep", "sweep.orphans")
    assert detached_run not in again.stdout and orphan not in again.stdout
    assert "sweep.expire_leases" not in again.stdout


def test_reap_rejects_an_unknown_sweep(stack: WorkerStack) -> None:
    done = reap(stack, "--dry-run", "--sweep", "sweep.nope")
    assert done.returncode != 0 and "unknown sweep(s) sweep.nope" in done.stderr
