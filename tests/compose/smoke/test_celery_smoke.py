"""Smoke tests with pytest-celery against the compose-built worker image (see conftest.py):
every lifecycle task sent by name, a transient provider error retried, and a worker
process killed mid-acquire with the task redelivered."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pytest_celery import RESULT_TIMEOUT, CeleryTestSetup

from models.schema import LeaseState
from models.store import Store
from providers.faulty import FaultPlan
from tests.e2e.conftest import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _call(setup: CeleryTestSetup, name: str, **kwargs: Any) -> Any:
    return setup.app.send_task(name, kwargs=kwargs).get(timeout=RESULT_TIMEOUT)


def test_each_lifecycle_task_by_name(celery_setup: CeleryTestSetup,
                                     worker_store: Store) -> None:
    acquired = _call(celery_setup, "lease.acquire", run_id="smoke-1",
                     spec={"thread_id": "t-1", "secret_env": {"TOKEN": "s3cret-smoke"}})
    assert (acquired["result"], acquired["state"]) == ("acquired", "active")
    lease_id = acquired["lease_id"]
    checked = _call(celery_setup, "lease.resume_check", lease_id=lease_id)
    assert checked["outcome"] == "resumable", checked
    assert _call(celery_setup, "lease.touch", lease_id=lease_id)["touched"] is True
    assert _call(celery_setup, "run.detach", run_id="smoke-1")["change"] == "changed"
    assert _call(celery_setup, "run.attach", run_id="smoke-1")["change"] == "changed"
    finished = _call(celery_setup, "run.finish", run_id="smoke-1", status="completed",
                     exit_code=0)
    assert finished["reclaim_enqueued"] is True
    eventually(lambda: worker_store.get_lease(lease_id).state == LeaseState.DESTROYED, 120,
               "run.finish's sandbox.reclaim to destroy the lease")
    again = _call(celery_setup, "sandbox.reclaim", run_id="smoke-1")
    # already reclaimed: the same answer, nothing done
    assert (again["outcome"], again["detail"]) == ("destroyed", "already reclaimed"), again

    second = _call(celery_setup, "lease.acquire", run_id="smoke-2", spec={})
    destroyed = _call(celery_setup, "lease.destroy", lease_id=second["lease_id"])
    assert destroyed["result"] == "destroyed" and destroyed["state"] == "destroyed"
    assert "s3cret-smoke" not in celery_setup.worker.logs()


def _taken(plan: FaultPlan, operation: str) -> int:
    rules: list[dict[str, Any]] = json.loads(plan.path.read_text())[operation]
    return sum(int(rule.get("taken", 0)) for rule in rules)


def test_a_transient_provider_error_is_retried(celery_setup: CeleryTestSetup,
                                               fault_plan: FaultPlan,
                                               worker_store: Store) -> None:
    fault_plan.write({"acquire": [{"fault": "transient", "when": "before", "times": 1}]})
    acquired = _call(celery_setup, "lease.acquire", run_id="smoke-retry",
                     spec={"provider": "faulty"})
    assert (acquired["result"], acquired["state"]) == ("acquired", "active")
    assert _taken(fault_plan, "acquire") == 1  # the first try failed, the retry won
    assert "Retry in" in celery_setup.worker.logs()
    lease = worker_store.get_lease(acquired["lease_id"])
    assert lease.state == LeaseState.ACTIVE and lease.provider == "faulty"


def test_a_worker_process_killed_mid_acquire_is_redelivered(celery_setup: CeleryTestSetup,
                                                            fault_plan: FaultPlan,
                                                            worker_store: Store) -> None:
    # SIGKILL the pool process after the sandbox exists, before the task returns.
    fault_plan.write({"acquire": [{"fault": "kill_worker", "when": "after", "times": 1}]})
    acquired = _call(celery_setup, "lease.acquire", run_id="smoke-killed",
                     spec={"provider": "faulty"})
    assert _taken(fault_plan, "acquire") == 1
    assert acquired["result"] == "adopted"  # the redelivery adopted what the killed one made
    assert "WorkerLostError" in celery_setup.worker.logs()
    leases = [lease for lease in worker_store.leases() if lease.run_id == "smoke-killed"]
    assert [lease.state for lease in leases] == [LeaseState.ACTIVE]
