"""A run's acquire repeated: with the same spec it is answered ``already_acquired``; with
another spec it is refused, naming the fields that differ, and the run's sandbox is left
alone (tasks/same_spec.py). On SQLite and PostgreSQL, over real local sandboxes."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from models.schema import LeaseState, RunStatus
from providers.base import ResumeOutcome
from providers.errors import InvalidRequest, TransientProviderError
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tasks.acquire import AcquireResult, acquire_lease
from tasks.leases import handle
from workers.runtime import Runtime

SECRET = "tok-5f2c9e0d7a1b"  # a value no message may show
FIRST = SandboxSpec(env={"MODE": "a"}, labels={"team": "x"},
                    secret_env={"TOKEN": SecretStr(SECRET)})


def untouched(rt: Runtime, run_id: str, lease_id: str, spec: SandboxSpec) -> None:
    """The run still holds its active lease, as acquired, and its sandbox still runs."""
    lease, run = rt.store.get_lease(lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id, lease.spec) == (LeaseState.ACTIVE, run_id,
                                                       spec.redacted())
    assert run is not None and (run.status, run.lease_id, run.error) == (
        RunStatus.RUNNING, lease_id, None)
    provider = rt.provider(lease.provider)
    assert provider.resume_check(handle(lease), 5).outcome == ResumeOutcome.RESUMABLE


@pytest.mark.parametrize(("changed", "fields"), [
    (FIRST.model_copy(update={"env": {"MODE": "b"}}), "env"),
    (FIRST.model_copy(update={"command": ["sleep", "300"], "ttl_s": 60}), "command, ttl_s"),
    (FIRST.model_copy(update={"secret_env": {"OTHER": SecretStr(SECRET)}}), "secret_env"),
    (FIRST.model_copy(update={"labels": {}, "tenant": "acme"}), "labels, tenant"),
], ids=["env", "command-ttl", "secret-renamed", "labels-tenant"])
def test_the_same_run_with_another_spec_is_refused_and_its_sandbox_kept(
    rt: Runtime, changed: SandboxSpec, fields: str
) -> None:
    first = acquire_lease(rt, "run-1", FIRST, None, may_retry=False)
    with pytest.raises(InvalidRequest) as refused:
        acquire_lease(rt, "run-1", changed, None, may_retry=False)
    message = str(refused.value)
    assert f"run run-1 already has lease {first.lease_id} (active)" in message
    assert f"(differing fields: {fields})" in message
    assert "start a new run (a new run_id) for this spec, or send the same spec" in message
    assert SECRET not in message and "MODE" not in message  # names fields, never values
    untouched(rt, "run-1", first.lease_id, FIRST)
    assert len(rt.provider("local").list_managed()) == 1  # nothing made for the other spec
    # ...and a redelivery of the first spec is still answered as before.
    again = acquire_lease(rt, "run-1", FIRST, None, may_retry=False)
    assert (again.result, again.lease_id) == (AcquireResult.ALREADY_ACQUIRED, first.lease_id)


def test_a_changed_secret_value_cannot_be_seen_and_counts_as_the_same_spec(rt: Runtime) -> None:
    # The store keeps secret values as ***: the documented limit of the comparison.
    first = acquire_lease(rt, "run-1", FIRST, None, may_retry=False)
    other = FIRST.model_copy(update={"secret_env": {"TOKEN": SecretStr("another-value")}})
    again = acquire_lease(rt, "run-1", other, None, may_retry=False)
    assert (again.result, again.lease_id) == (AcquireResult.ALREADY_ACQUIRED, first.lease_id)


def test_a_provisioning_lease_refuses_another_spec_and_its_retry_still_adopts(
    rt: Runtime, faults: FaultPlan
) -> None:
    # The first attempt failed transiently after creating the sandbox: its retry adopts it.
    faults.write({"acquire": [{"fault": "transient", "when": "after", "times": 1}]})
    spec = SandboxSpec(provider="faulty", env={"MODE": "a"})
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", spec, None, may_retry=True)
    (lease,) = rt.store.leases()
    other = spec.model_copy(update={"env": {"MODE": "b"}})
    with pytest.raises(InvalidRequest, match=rf"lease {lease.lease_id} \(provisioning\).*"
                                             r"differing fields: env\)"):
        acquire_lease(rt, "run-1", other, None, may_retry=True)
    assert rt.store.get_lease(lease.lease_id).state == LeaseState.PROVISIONING
    done = acquire_lease(rt, "run-1", spec, None, may_retry=True)
    assert (done.result, done.lease_id) == (AcquireResult.ADOPTED, lease.lease_id)
    untouched(rt, "run-1", lease.lease_id, spec)


def test_a_run_reusing_the_threads_sandbox_is_compared_on_what_selects_it(rt: Runtime) -> None:
    # The thread's sandbox was made for run-1's spec; run-2 took it as it is, with its own
    # env: run-2's redelivery is the same acquire, but not run-2 without reuse.
    made = SandboxSpec(thread_id="th-1", reuse=True, env={"MODE": "a"})
    taken = made.model_copy(update={"env": {"MODE": "b"}})
    first = acquire_lease(rt, "run-1", made, None, may_retry=False)
    reused = acquire_lease(rt, "run-2", taken, None, may_retry=False)
    assert (reused.result, reused.lease_id) == (AcquireResult.REUSED, first.lease_id)
    again = acquire_lease(rt, "run-2", taken, None, may_retry=False)
    assert (again.result, again.lease_id) == (AcquireResult.ALREADY_ACQUIRED, first.lease_id)
    with pytest.raises(InvalidRequest, match=r"run run-2 already has lease .*differing "
                                             r"fields: reuse\)"):
        acquire_lease(rt, "run-2", taken.model_copy(update={"reuse": False}), None,
                      may_retry=False)
    with pytest.raises(InvalidRequest, match=r"differing fields: thread_id\)"):
        acquire_lease(rt, "run-2", taken.model_copy(update={"thread_id": "th-2"}), None,
                      may_retry=False)
    untouched(rt, "run-2", first.lease_id, made)
    run1 = rt.store.get_run("run-1")
    assert run1 is not None and run1.status == RunStatus.RUNNING
