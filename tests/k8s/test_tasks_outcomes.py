"""Owns the tests of the remaining reachable outcomes of the tasks on the Kubernetes
provider, through a real worker (``kube_stack``) and the real API server: reclaim's
``destroy-failed``, ``not-found`` and ``provider-mismatch``; the resume check of a
terminating Sandbox and of a Failed Job; unexpected errors (403, 500) on Job and pod reads
during a resume check, which fail the task and leave the lease alone; and a Job killed by
its active deadline, whose run ``sweep.finish_exited`` finishes as failed without an exit
code."""

from __future__ import annotations

from typing import Any

import pytest

from models.schema import LeaseState, ReclaimOutcome, RunStatus
from providers.errors import (
    SandboxReclaimFailedError,
    TerminalProviderError,
    TransientProviderError,
)
from tasks import producer
from tests.cluster.waits import condition_is, gone
from tests.k8s.conftest import KubeStack
from tests.k8s.test_tasks import LOOP, acquire, ended, eventually, not_resumable, rid
from workers.app import app

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
HOLD = "test.leasekeeper.dev/hold"


def reclaimed(ks: KubeStack, run_id: str) -> ReclaimOutcome:
    return ReclaimOutcome(eventually(lambda: ks.run(run_id).reclaim_outcome, "the reclaim"))


# -- reclaim ----------------------------------------------------------------------------------

def test_reclaim_destroy_failed_keeps_the_lease_for_the_retry_sweep(kube_stack: KubeStack
                                                                    ) -> None:
    # given a live lease whose Sandbox delete keeps answering 500
    ks = kube_stack
    run_id = rid()
    acquired = acquire(ks, run_id)
    lease_id, name = acquired["lease_id"], acquired["provider_lease_id"]
    ks.proxy.fail("DELETE", rf"/sandboxes/{name}$", 500, times=None)
    # when its run finishes; then the reclaim reports destroy-failed and fails loudly
    assert producer.finish_run(run_id, "completed", 0).get(30)["reclaim_enqueued"] is True
    assert reclaimed(ks, run_id) == ReclaimOutcome.DESTROY_FAILED
    # and the lease waits in pending_cleanup, no longer resumable, its Sandbox still there
    lease = ks.lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 1
    assert lease.last_error is not None and "HTTP 500" in lease.last_error
    # and what is recorded promises no retry of the task (sweep.retry_cleanup does that)
    assert "the task retries" not in lease.last_error, lease.last_error
    assert ks.env.read("sandbox", name) is not None
    checked = producer.check_resumable(lease_id).get(60)
    assert checked["resumable"] is False and checked["reason"] == "lease is pending_cleanup"
    # and a reclaim sent again fails loudly to its caller, saying what happened
    with pytest.raises(SandboxReclaimFailedError) as info:
        app.send_task("sandbox.reclaim", kwargs={"run_id": run_id}).get(60)
    text = str(info.value)
    assert f'reclaiming the sandbox for run "{run_id}" failed' in text and "HTTP 500" in text
    assert ks.lease(lease_id).state == LeaseState.PENDING_CLEANUP
    # once the API server lets it, sweep.retry_cleanup destroys it
    ks.proxy.clear_rules()
    app.send_task("sweep.retry_cleanup").get(60)
    assert ended(ks, lease_id) == LeaseState.DESTROYED
    ks.env.wait("sandbox", name, gone)


def test_reclaim_not_found_when_the_lease_is_already_destroyed(kube_stack: KubeStack) -> None:
    # given a run whose lease was destroyed before the run finished
    ks = kube_stack
    run_id = rid()
    acquired = acquire(ks, run_id)
    assert producer.destroy_lease(acquired["lease_id"]).get(60)["result"] == "destroyed"
    ks.env.wait("sandbox", acquired["provider_lease_id"], gone)
    ks.proxy.reset_counts()
    # the lease's end settled its run (runs never lie): a late run.finish changes nothing
    run = ks.run(run_id)
    assert run.status == RunStatus.ABORTED and acquired["lease_id"] in (run.error or "")
    assert producer.finish_run(run_id, "completed", 0).get(30)["change"] == "unchanged"
    # when the run is reclaimed; then it finds nothing to destroy, and asks nothing
    assert producer.reclaim_run(run_id).get(60)["outcome"] == ReclaimOutcome.NOT_FOUND
    assert reclaimed(ks, run_id) == ReclaimOutcome.NOT_FOUND
    assert ks.proxy.count() == 0


def test_reclaim_provider_mismatch_touches_nothing(kube_stack: KubeStack) -> None:
    # given a live kubernetes lease, and a run of another provider bound to its sandbox key
    # (another worker's run: provider local), now finished
    ks = kube_stack
    acquired = acquire(ks, rid())
    lease_id, name, key = (acquired["lease_id"], acquired["provider_lease_id"],
                           acquired["sandbox_key"])
    other = rid()
    ks.store.start_run(other, None, "local", key)
    ks.store.bind_run(other, lease_id, key)
    ks.store.finish_run(other, RunStatus.COMPLETED, 0, None, reclaim_due=False,
                        claim_until=None)
    ks.proxy.reset_counts()
    # when its reclaim runs; then it refuses: provider-mismatch, the lease and Sandbox untouched
    result = app.send_task("sandbox.reclaim", kwargs={"run_id": other}).get(60)
    assert result["outcome"] == ReclaimOutcome.PROVIDER_MISMATCH
    assert result["detail"] == "lease provider kubernetes"
    assert ks.run(other).reclaim_outcome == ReclaimOutcome.PROVIDER_MISMATCH
    assert ks.lease(lease_id).state == LeaseState.ACTIVE
    assert ks.proxy.count() == 0
    assert ks.env.read("sandbox", name) is not None
    assert producer.check_resumable(lease_id).get(60)["resumable"] is True


# -- resume check -----------------------------------------------------------------------------

def test_resume_sandbox_terminating(kube_stack: KubeStack) -> None:
    # given a live lease whose Sandbox is being deleted (a finalizer keeps it terminating)
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    ks.env.custom.patch_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes", name,
        {"metadata": {"finalizers": [HOLD]}})
    ks.env.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes", name, _preload_content=False)
    try:
        ks.env.wait("sandbox", name,
                    lambda sb: bool(sb and sb["metadata"].get("deletionTimestamp")))
        # when checking resume; then it is not resumable at once, and destroyed
        assert not_resumable(ks, acquired["lease_id"]) == f"Sandbox {name} is terminating"
        assert ks.env.read("secret", f"{name}-env") is None
    finally:
        ks.env.custom.patch_namespaced_custom_object(
            "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes", name,
            {"metadata": {"finalizers": None}})
    ks.env.wait("sandbox", name, gone)


def test_resume_job_failed(kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    acquired = acquire(ks, run_id, backend="job", command=["sh", "-c", "exit 3"])
    name = acquired["provider_lease_id"]
    ks.env.wait("job", name, condition_is("Failed"))
    assert not_resumable(ks, acquired["lease_id"]) == "Job is Failed"
    ks.env.wait("job", name, gone)
    # its run is recorded as sweep.finish_exited records it, not aborted by the destroy
    run = ks.run(run_id)
    assert (run.status, run.exit_code, run.error) == (
        RunStatus.FAILED, 3, "the sandbox command exited with code 3")


# backend, the read that fails (method, path regex with {name}), the answer, the error
READ_FAILURES = [
    ("job", "GET", r"/jobs/{name}$", 403, TerminalProviderError, 'verb "get" on resource "jobs"'),
    ("job", "GET", r"/jobs/{name}$", 500, TransientProviderError, "HTTP 500"),
    ("job", "GET", r"/pods$", 403, TerminalProviderError, 'verb "list" on resource "pods"'),
    ("job", "GET", r"/pods$", 500, TransientProviderError, "HTTP 500"),
    ("sandbox-cr", "GET", r"/pods/{name}$", 403, TerminalProviderError,
     'verb "get" on resource "pods"'),
    ("sandbox-cr", "GET", r"/pods/{name}$", 500, TransientProviderError, "HTTP 500"),
]


@pytest.mark.parametrize(("backend", "method", "path", "code", "error", "says"), READ_FAILURES)
def test_resume_read_errors_propagate_and_leave_the_lease_alone(
        kube_stack: KubeStack, backend: str, method: str, path: str, code: int,
        error: type[Exception], says: str) -> None:
    # given a live lease, and the API server failing one read the resume check needs
    ks = kube_stack
    acquired = acquire(ks, backend=backend, command=LOOP)
    lease_id, name = acquired["lease_id"], acquired["provider_lease_id"]
    if backend == "job":
        ks.env.wait("job", name, lambda j: (j or {}).get("status", {}).get("active") == 1)
    ks.proxy.reset_counts()
    ks.proxy.fail(method, path.format(name=name), code, times=None)
    # when checking resume; then the task fails with that error (a 500 after its retries)
    with pytest.raises(error) as info:
        producer.check_resumable(lease_id).get(60)
    text = str(info.value)
    assert f"HTTP {code}" in text and says in text, text
    if error is TransientProviderError:  # the final error says the retries ran out
        assert "the task retries" not in text, text
        assert "the task gave up after 2 retries (LEASEKEEPER_TASK_MAX_RETRIES)" in text, text
    # and an error is not an answer: the lease stays active, nothing is deleted
    assert ks.lease(lease_id).state == LeaseState.ACTIVE
    assert ks.proxy.count("DELETE") == 0
    ks.proxy.clear_rules()
    assert producer.check_resumable(lease_id).get(60)["resumable"] is True


def test_a_closed_api_server_port_is_named_as_refused_and_the_final_error_says_so(
        kube_stack: KubeStack) -> None:
    # given a live lease, and then nothing listening where the worker's kubeconfig points
    ks = kube_stack
    lease_id = acquire(ks, command=LOOP)["lease_id"]
    address = ks.proxy.url.removeprefix("https://")
    ks.proxy.stop()  # the stack is retired after this test; its proxy is not used again
    # when checking resume; then, after its retries, the task fails saying it could not
    # connect, where to, and why (not a timeout), and that it gave up retrying
    with pytest.raises(TransientProviderError) as info:
        producer.check_resumable(lease_id).get(60)
    text = str(info.value)
    assert (f"could not connect to the API server at {address} (connection refused; is it "
            "running, and is the kubeconfig/in-cluster address right?)") in text, text
    assert "did not answer within" not in text, text
    assert "the task retries" not in text, text
    assert text.endswith("; the task gave up after 2 retries "
                         "(LEASEKEEPER_TASK_MAX_RETRIES)"), text
    # and an error is not an answer: the lease stays active
    assert ks.lease(lease_id).state == LeaseState.ACTIVE


# -- a Job killed by its active deadline ------------------------------------------------------

def test_an_acquire_that_gave_up_records_no_promise_of_a_retry(kube_stack: KubeStack) -> None:
    # given an API server that answers 500 to every Sandbox create
    ks = kube_stack
    run_id = rid()
    ks.proxy.fail("POST", r"/sandboxes$", 500, times=None)
    # when acquiring; then the task fails after its retries, saying it gave up
    with pytest.raises(TransientProviderError) as info:
        producer.acquire_lease(run_id, {"tenant": "acme"}).get(90)
    assert "the task gave up after 2 retries" in str(info.value), str(info.value)
    ks.proxy.clear_rules()
    # and the run's error, the lease's last error and its history say the same: none of
    # them promises a retry that will never come
    run = ks.run(run_id)
    assert run.status == RunStatus.FAILED and run.error is not None and run.lease_id
    assert "HTTP 500" in run.error and "the task retries" not in run.error, run.error
    lease = ks.lease(run.lease_id)
    assert lease.last_error is not None and "HTTP 500" in lease.last_error
    assert "the task retries" not in lease.last_error, lease.last_error
    for event in ks.store.events(run.lease_id):
        assert "the task retries" not in event.reason, event.reason
    assert ended(ks, run.lease_id) == LeaseState.DESTROYED


def test_a_job_killed_by_its_deadline_finishes_its_run_failed_without_exit_code(
        kube_stack: KubeStack) -> None:
    # given a Job lease whose command outlives its active deadline (the spec's TTL: 1 s)
    ks = kube_stack
    run_id = rid()
    acquired = acquire(ks, run_id, backend="job", command=LOOP, ttl_s=1)
    name = acquired["provider_lease_id"]

    def deadline_exceeded(job: dict[str, Any] | None) -> bool:
        return any(c.get("type") == "Failed" and c.get("status") == "True"
                   and c.get("reason") == "DeadlineExceeded"
                   for c in (job or {}).get("status", {}).get("conditions") or [])

    ks.env.wait("job", name, deadline_exceeded)
    # when sweep.finish_exited runs; then the run is finished as failed, reason given,
    # exit code null, and its sandbox is reclaimed
    summary = app.send_task("sweep.finish_exited").get(60)
    assert (summary["failed"], summary["reclaims_enqueued"]) == (1, 1), summary
    assert f"failed {run_id} (DeadlineExceeded, no exit code)" in summary["items"]
    run = eventually(lambda: (r := ks.run(run_id)).reclaim_outcome and r, "the reclaim")
    assert (run.status, run.exit_code) == (RunStatus.FAILED, None)
    assert run.error is not None and "DeadlineExceeded" in run.error
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert ks.lease(acquired["lease_id"]).state == LeaseState.DESTROYED
    ks.env.wait("job", name, gone)
    again = app.send_task("sweep.finish_exited").get(60)
    assert (again["failed"], again["reclaims_enqueued"]) == (0, 0)
