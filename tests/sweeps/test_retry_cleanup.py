"""sweep.retry_cleanup: pending_cleanup leases are destroyed again, oldest first, after
their backoff, up to the attempt cap, after which they are abandoned, logged above
warning and counted; `leasekeeper leases retry|forget` act on abandoned leases."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from models.schema import LeaseState, utcnow
from providers.faulty import FaultPlan
from tasks.destroy import DestroyResult, destroy_lease
from tasks.orphans import OrphanOutcome, orphans
from tasks.sweeping import SweepContext
from tasks.sweeps import CleanupOutcome, retry_cleanup
from tests.stack import REPO
from tests.sweeps.conftest import (
    Recorder,
    acquire,
    concurrently,
    events_to,
    set_lease,
)
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(120)


def mark_for_cleanup(rt: Runtime, lease_id: str) -> None:
    assert rt.store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.PENDING_CLEANUP,
                               "test: needs cleanup", next_cleanup_at=utcnow())


def test_oldest_lease_first_within_the_batch(runtime_with: Callable[..., Runtime]) -> None:
    rt = runtime_with(cleanup_batch_size=2)
    effects = Recorder(rt)
    leases = [acquire(rt, f"run-{i}", provider="noop") for i in range(3)]
    base = utcnow() - timedelta(hours=1)
    for age, lease_id in zip([1, 3, 2], leases, strict=True):  # leases[1] is the oldest
        mark_for_cleanup(rt, lease_id)
        set_lease(rt, lease_id, created_at=base - timedelta(minutes=age))
    tally = retry_cleanup(SweepContext(rt, effects))
    assert tally[CleanupOutcome.DESTROYS_ENQUEUED] == 2
    assert [lid for lid, _ in effects.destroys] == [leases[1], leases[2]]
    retry_cleanup(SweepContext(rt, effects))  # the next tick takes the rest
    assert [lid for lid, _ in effects.destroys][2:] == [leases[0]]


def test_backoff_then_cap_then_abandoned_logged_and_counted(
    runtime_with: Callable[..., Runtime], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = runtime_with(cleanup_backoff_s=30, cleanup_max_attempts=3)
    effects = Recorder(rt, inline=True)
    faults = FaultPlan(tmp_path / "faults.json")
    lease_id = acquire(rt, "run-1", provider="faulty")
    faults.write({"destroy": [{"fault": "terminal", "times": 3}]})
    assert destroy_lease(rt, lease_id, "x", None).result == DestroyResult.CLEANUP_PENDING
    lease = rt.store.get_lease(lease_id)
    assert lease.cleanup_attempts == 1 and lease.next_cleanup_at > utcnow() + timedelta(seconds=25)
    assert retry_cleanup(SweepContext(rt, effects))[CleanupOutcome.DESTROYS_ENQUEUED] == 0
    set_lease(rt, lease_id, next_cleanup_at=utcnow())  # the backoff has passed (inclusive)
    retry_cleanup(SweepContext(rt, effects))  # attempt 2 fails; backoff doubles
    lease = rt.store.get_lease(lease_id)
    assert lease.cleanup_attempts == 2 and lease.next_cleanup_at > utcnow() + timedelta(seconds=55)
    set_lease(rt, lease_id, next_cleanup_at=utcnow())
    with caplog.at_level(logging.WARNING):
        tally = retry_cleanup(SweepContext(rt, effects))  # attempt 3: the cap
    assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    assert tally[CleanupOutcome.ABANDONED_TOTAL] == 1
    abandoned = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert abandoned and all(r.levelno > logging.WARNING for r in abandoned)
    assert sum(v for k, v in retry_cleanup(SweepContext(rt, effects)).counts.items()
               if k != "abandoned_total") == 0  # an abandoned lease is never retried alone
    assert len(rt.provider("faulty").list_managed()) == 1  # and its sandbox still accounted for


def test_a_destroy_whose_worker_died_is_recovered_and_counted_as_an_attempt(
    runtime_with: Callable[..., Runtime],
) -> None:
    rt = runtime_with(claim_timeout_s=5, cleanup_max_attempts=2)
    effects = Recorder(rt)
    first, second = acquire(rt, "run-1"), acquire(rt, "run-2")
    for lease_id in (first, second):  # a worker claimed the destroy, then died
        assert rt.store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.DESTROYING, "x")
    set_lease(rt, first, updated_at=utcnow() - timedelta(seconds=5))  # the claim ran out
    set_lease(rt, second, updated_at=utcnow() - timedelta(seconds=5), cleanup_attempts=1)
    tally = retry_cleanup(SweepContext(rt, effects))
    assert tally[CleanupOutcome.RECOVERED_STALE_DESTROYS] == 1
    assert tally[CleanupOutcome.ABANDONED] == 1 and tally[CleanupOutcome.ABANDONED_TOTAL] == 1
    assert rt.store.get_lease(first).cleanup_attempts == 1
    assert rt.store.get_lease(second).state == LeaseState.ABANDONED
    assert effects.destroys == [(first, "retry cleanup")]  # recovered and retried at once


def test_a_destroy_still_within_its_claim_is_left_alone(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1")
    rt.store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.DESTROYING, "in flight")
    assert sum(retry_cleanup(SweepContext(rt, effects)).counts.values()) == 0
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYING


def test_overlapping_ticks_destroy_each_lease_once(rt: Runtime, effects: Recorder) -> None:
    leases = [acquire(rt, f"run-{i}") for i in range(6)]
    for lease_id in leases:
        mark_for_cleanup(rt, lease_id)
    effects.inline = True
    tallies = concurrently([lambda: retry_cleanup(SweepContext(rt, effects))] * 3)
    assert sum(t[CleanupOutcome.DESTROYS_ENQUEUED] for t in tallies) == 6
    for lease_id in leases:
        assert events_to(rt, lease_id, LeaseState.DESTROYED) == 1
        assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_dry_run_changes_nothing(rt: Runtime, effects: Recorder) -> None:
    lease_id = acquire(rt, "run-1")
    mark_for_cleanup(rt, lease_id)
    due = rt.store.get_lease(lease_id).next_cleanup_at
    tally = retry_cleanup(SweepContext(rt, effects, dry_run=True))
    assert tally[CleanupOutcome.DESTROYS_ENQUEUED] == 1 and effects.destroys == []
    assert rt.store.get_lease(lease_id).next_cleanup_at == due


def cli(rt: Runtime, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env |= {"LEASEKEEPER_STORE_URL": rt.settings.effective_store_url,
            "LEASEKEEPER_VAR_DIR": str(rt.settings.var_dir),
            "LEASEKEEPER_BROKER_URL": os.environ["LEASEKEEPER_BROKER_URL"],
            "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def test_operator_retry_gives_an_abandoned_lease_fresh_attempts_and_forget_ends_it(
    rt: Runtime, effects: Recorder, faults: FaultPlan
) -> None:
    retried, forgotten = acquire(rt, "run-1", provider="faulty"), acquire(rt, "run-2",
                                                                          provider="faulty")
    faults.write({"destroy": [{"fault": "terminal", "times": 6}]})
    for lease_id in (retried, forgotten):
        for _ in range(3):
            destroy_lease(rt, lease_id, "x", None)
        assert rt.store.get_lease(lease_id).state == LeaseState.ABANDONED
    listed = cli(rt, "leases", "list", "--state", "abandoned")
    assert retried in listed.stdout and forgotten in listed.stdout

    assert cli(rt, "leases", "retry", retried).returncode == 0
    lease = rt.store.get_lease(retried)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 0
    effects.inline = True
    retry_cleanup(SweepContext(rt, effects))  # the provider is fixed now: it goes
    assert rt.store.get_lease(retried).state == LeaseState.DESTROYED

    done = cli(rt, "leases", "forget", forgotten, "--reason", "deleted by hand")
    assert done.returncode == 0 and "forgotten" in done.stdout
    lease = rt.store.get_lease(forgotten)
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "forgotten"
    assert "operator: forgotten (deleted by hand)" in cli(rt, "leases", "show", forgotten).stdout
    # It was not, in fact, deleted: sweep.orphans finds it and cleans it up, with fresh
    # attempts (forget resets them), and the provider now works.
    record = Path(rt.settings.effective_local_root) / "faulty" / f"lk-{forgotten}" / "lease.json"
    data = json.loads(record.read_text())
    old = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    record.write_text(json.dumps({**data, "created_at": old}))
    assert orphans(SweepContext(rt, effects))[OrphanOutcome.REVIVED] == 1
    assert rt.store.get_lease(forgotten).state == LeaseState.DESTROYED
    assert rt.provider("faulty").list_managed() == []
    # Only abandoned leases take either command: any other is bad input (exit 2).
    for command in ("retry", "forget"):
        refused = cli(rt, "leases", command, retried)
        assert refused.returncode == 2 and "is destroyed" in refused.stderr, refused
