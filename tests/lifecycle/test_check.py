"""``leasekeeper check``: each invariant of models/invariants.py, broken on purpose behind
the system's back, is reported (and only it); a clean lifecycle reports nothing; the
command prints the violations, as JSON too, and exits non-zero on any. SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import delete, update

from models.invariants import Rule, check
from models.schema import Lease, LeaseState, ReclaimOutcome, Run, RunStatus, utcnow
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.reclaim import reclaim_run
from tasks.runs import finish
from tests.stack import REPO
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(90)


def acquire(rt: Runtime, run_id: str, **spec: Any) -> str:
    parsed = SandboxSpec.model_validate({"provider": "noop", **spec})
    return acquire_lease(rt, run_id, parsed, None, False).lease_id


def behind_our_back(rt: Runtime, table: Any, key: Any, ident: str, **values: Any) -> None:
    with rt.store.tx() as s:
        s.execute(update(table).where(key == ident).values(**values))


def rules(rt: Runtime) -> list[tuple[Rule, str | None, str | None]]:
    found = check(rt.store, utcnow(), rt.settings.claim_timeout_s)
    return [(v.rule, v.lease_id, v.run_id) for v in found]


def test_a_clean_lifecycle_has_no_violations(rt: Runtime) -> None:
    acquire(rt, "run-done")
    finish(rt, "run-done", RunStatus.COMPLETED, 0, None)
    assert reclaim_run(rt, "run-done", None).outcome == ReclaimOutcome.DESTROYED
    acquire(rt, "run-live")
    reused = acquire(rt, "run-a", thread_id="th", reuse=True)
    acquire(rt, "run-b", thread_id="th", reuse=True)
    finish(rt, "run-a", RunStatus.COMPLETED, 0, None)  # its reused sandbox stays: fine
    behind_our_back(rt, Run, Run.run_id, "run-a", finished_at=utcnow() - timedelta(hours=1))
    assert rt.store.get_lease(reused).state == LeaseState.ACTIVE
    assert rules(rt) == []


def test_a_running_run_on_an_ended_lease(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    behind_our_back(rt, Lease, Lease.lease_id, lease_id, state=LeaseState.DESTROYED,
                    live_key=None)
    assert rules(rt) == [(Rule.RUN_ON_ENDED_LEASE, lease_id, "run-1")]


def test_a_live_lease_without_its_run(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    with rt.store.tx() as s:
        s.execute(delete(Run).where(Run.run_id == "run-1"))
    assert rules(rt) == [(Rule.LIVE_LEASE_WITHOUT_RUN, lease_id, "run-1")]


def test_a_terminal_run_whose_ephemeral_lease_nobody_reclaims(rt: Runtime) -> None:
    lease_id = acquire(rt, "run-1")
    finish(rt, "run-1", RunStatus.FAILED, 3, None)  # its reclaim message was lost
    assert rules(rt) == []  # within the claim timeout: a reclaim may be on its way
    behind_our_back(rt, Run, Run.run_id, "run-1",
                    finished_at=utcnow() - timedelta(seconds=rt.settings.claim_timeout_s + 1))
    assert rules(rt) == [(Rule.UNRECLAIMED_EPHEMERAL_LEASE, lease_id, "run-1")]


@pytest.mark.parametrize(("outcome", "state"), [
    (ReclaimOutcome.DESTROYED, LeaseState.PENDING_CLEANUP),
    (ReclaimOutcome.DESTROY_FAILED, LeaseState.DESTROYED),
    (ReclaimOutcome.NOT_FOUND, LeaseState.ABANDONED),
])
def test_a_reclaim_outcome_that_contradicts_the_lease(
    rt: Runtime, outcome: ReclaimOutcome, state: LeaseState
) -> None:
    lease_id = acquire(rt, "run-1")
    finish(rt, "run-1", RunStatus.COMPLETED, 0, None)
    behind_our_back(rt, Run, Run.run_id, "run-1", reclaim_outcome=outcome)
    behind_our_back(rt, Lease, Lease.lease_id, lease_id, state=state, live_key=None)
    assert rules(rt) == [(Rule.RECLAIM_OUTCOME_MISMATCH, lease_id, "run-1")]


def test_the_command_prints_violations_as_json_and_exits_non_zero(rt: Runtime) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")},
           "LEASEKEEPER_STORE_URL": rt.store.url, "LEASEKEEPER_VAR_DIR": str(
               rt.settings.var_dir), "PYTHONPATH": str(REPO)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "workers.cli", "check", *args], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=60,
                              check=False)

    acquire(rt, "run-ok")
    clean = run()
    assert (clean.returncode, clean.stdout.strip()) == (0, "no violations"), clean.stderr
    lease_id = acquire(rt, "run-1")
    with rt.store.tx() as s:
        s.execute(delete(Run).where(Run.run_id == "run-1"))
    plain = run()
    assert plain.returncode == 1 and "1 violation(s)" in plain.stdout
    assert f"live-lease-without-run: lease {lease_id} run run-1" in plain.stdout
    as_json = run("--json")
    assert as_json.returncode == 1
    (violation,) = json.loads(as_json.stdout)["violations"]
    assert violation["rule"] == "live-lease-without-run"
    assert (violation["lease_id"], violation["run_id"]) == (lease_id, "run-1")
