"""Owns the tests of the Kubernetes provider driven through the Celery tasks: the producer API
over the real broker to a real worker (``kube_stack``), against the real API server, its Job
controller and garbage collector. Each test asserts on the store and on the real objects:
acquire (both backends), every reachable resume-check outcome of the seed, destroy, reclaim,
acquire's partial-failure cleanup, adoption after a redelivery, and a Job's run finished with
its real exit code by ``sweep.finish_exited``."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from models.observe import Observe
from models.schema import LeaseState, ReclaimOutcome, RunStatus
from providers.errors import (
    AcquireCleanupIncomplete,
    DestroyIncomplete,
    TerminalProviderError,
)
from tasks import producer
from tests.cluster.waits import condition_is, gone, pod_phase_in
from tests.k8s.conftest import KubeStack
from workers.app import app

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

SECRET = "s3cr3t-" + uuid.uuid4().hex
LOOP = ["sh", "-c", "while :; do sleep 1; done"]
T = TypeVar("T")


def rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def eventually(probe: Callable[[], T | None], what: str, timeout_s: float = 60.0) -> T:
    """probe()'s first truthy value, under a monotonic deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def acquire(ks: KubeStack, run_id: str | None = None, **spec: Any) -> dict[str, Any]:
    result: dict[str, Any] = producer.acquire_lease(
        run_id or rid(), {"tenant": "acme", **spec}).get(60)
    assert result["result"] == "acquired" and result["state"] == "active"
    return result


def ended(ks: KubeStack, lease_id: str) -> str:
    """Wait until the lease reaches a final state (a destroy was enqueued); return it."""
    return eventually(lambda: (s := ks.lease(lease_id).state) in
                      (LeaseState.DESTROYED, LeaseState.ABANDONED) and s, "the lease to end")


def not_resumable(ks: KubeStack, lease_id: str) -> str:
    """Check a lease that must not be resumable; return the reason. The task marks it
    pending_cleanup and enqueues lease.destroy, which destroys what is left."""
    checked = producer.check_resumable(lease_id).get(60)
    assert checked["resumable"] is False and checked["outcome"] == "not_resumable"
    assert ended(ks, lease_id) == LeaseState.DESTROYED
    assert ks.lease(lease_id).end_reason == "not_resumable"
    return str(checked["reason"])


# -- acquire, resume, finish, reclaim ---------------------------------------------------------

def test_sandbox_acquire_resume_finish_and_reclaim(kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    # given a lease acquired through the producer API, with a secret in its spec
    acquired = acquire(ks, run_id, env={"GREETING": "hi"}, secret_env={"API_KEY": SECRET})
    lease = ks.lease(acquired["lease_id"])
    name = acquired["provider_lease_id"]
    assert (acquired["provider"], acquired["backend"]) == ("kubernetes", "sandbox-cr")
    assert lease.state == LeaseState.ACTIVE and lease.ready_at is not None
    meta = lease.provider_meta
    assert meta["namespace"] == ks.namespace and meta["pod_name"] == name
    # then the real objects exist, labelled as this lease's, the Secret owned by the Sandbox
    sandbox = ks.env.read("sandbox", name)
    assert sandbox is not None and sandbox["metadata"]["uid"] == meta["uid"]
    labels = sandbox["metadata"]["labels"]
    assert labels["leasekeeper.dev/installation"] == ks.env.installation
    assert labels["leasekeeper.dev/lease-id"] == lease.lease_id
    assert labels["leasekeeper.dev/run-id"] == run_id
    secret = ks.env.read("secret", f"{name}-env")
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == meta["uid"]
    assert set(secret["data"]) == {"API_KEY", "LEASEKEEPER_BOOTSTRAP_TOKEN"}
    assert pod_phase_in("Running")(ks.env.read("pod", name))
    # when checking resume; then it is resumable on that pod
    checked = producer.check_resumable(lease.lease_id).get(60)
    assert checked["resumable"] is True
    assert checked["details"] == {"pod_name": name, "phase": "Running",
                                  "namespace": ks.namespace}
    # when the run finishes; then its sandbox is reclaimed: every object is gone
    assert producer.finish_run(run_id, "completed", 0).get(30)["reclaim_enqueued"] is True
    run = eventually(lambda: (r := ks.run(run_id)).reclaim_outcome and r, "the reclaim")
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert ks.lease(lease.lease_id).state == LeaseState.DESTROYED
    for kind, obj in (("sandbox", name), ("pod", name), ("secret", f"{name}-env")):
        ks.env.wait(kind, obj, gone)
    # and the secret value reached the Secret only: not results, store or worker log
    assert SECRET not in json.dumps([acquired, checked])
    assert SECRET not in ks.store_dump() and SECRET not in ks.worker_log()


def test_job_acquire_running_is_resumable_then_destroy(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks, backend="job", command=LOOP)
    name = acquired["provider_lease_id"]
    job = ks.env.read("job", name)
    assert job is not None and acquired["backend"] == "job"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 3600
    secret = ks.env.read("secret", f"{name}-env")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    ks.env.wait("job", name, lambda j: (j or {}).get("status", {}).get("active") == 1)
    checked = producer.check_resumable(acquired["lease_id"]).get(60)
    assert checked["resumable"] is True and checked["details"]["phase"] == "Running"
    assert checked["details"]["pod_name"].startswith(f"{name}-")
    assert producer.destroy_lease(acquired["lease_id"]).get(60)["result"] == "destroyed"
    assert ks.lease(acquired["lease_id"]).state == LeaseState.DESTROYED
    ks.env.wait("job", name, gone)
    ks.env.wait("pod", checked["details"]["pod_name"], gone)
    assert ks.env.read("secret", f"{name}-env") is None


# -- resume check: every reachable not-resumable outcome of the seed --------------------------

def test_resume_sandbox_gone(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    ks.env.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes", name, _preload_content=False)
    ks.env.wait("sandbox", name, gone)
    assert not_resumable(ks, acquired["lease_id"]) == "Sandbox CR no longer exists"


def test_resume_sandbox_failed(kube_stack: KubeStack, steered_controller: Any) -> None:
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    steered_controller.mark_failed(ks.namespace, name, "exit status 3")
    ks.env.wait("sandbox", name, condition_is("Finished"))
    reason = not_resumable(ks, acquired["lease_id"])
    assert "PodFailed" in reason and "exit status 3" in reason
    ks.env.wait("sandbox", name, gone)


def test_resume_sandbox_never_ready_again(kube_stack: KubeStack, steered_controller: Any) -> None:
    # given a live lease whose pod dies and is not replaced
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    steered_controller.never_ready(ks.namespace, name)
    ks.env.core.delete_namespaced_pod(name, ks.namespace, grace_period_seconds=0,
                                      _preload_content=False)
    ks.env.wait("sandbox", name, lambda sb: any(
        c["type"] == "Ready" and c.get("message") == "Pod does not exist"
        for c in (sb or {}).get("status", {}).get("conditions", [])))
    # when checking resume; then it waits the bounded time (LEASEKEEPER_RESUME_TIMEOUT_S=5)
    reason = not_resumable(ks, acquired["lease_id"])
    assert reason == (f"Sandbox {name} did not become Ready within 5s "
                      "(Ready=False (DependenciesNotReady: Pod does not exist))"), reason
    ks.env.wait("sandbox", name, gone)


def test_resume_pod_gone_while_the_sandbox_still_says_ready(kube_stack: KubeStack,
                                                           steered_controller: Any) -> None:
    # given a live lease whose pod is deleted while the controller lags (status still Ready)
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    steered_controller.freeze(ks.namespace, name)
    ks.env.core.delete_namespaced_pod(name, ks.namespace, grace_period_seconds=0,
                                      _preload_content=False)
    ks.env.wait("pod", name, gone)
    assert condition_is("Ready")(ks.env.read("sandbox", name))
    reason = not_resumable(ks, acquired["lease_id"])
    assert reason == "Sandbox is Ready but no backing pod was found"


def test_resume_pod_terminating(kube_stack: KubeStack, steered_controller: Any) -> None:
    # given a Ready Sandbox whose pod ignores SIGTERM, so its graceful deletion lingers,
    # and a controller that has not caught up with that yet
    ks = kube_stack
    acquired = acquire(ks, command=["sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
    name = acquired["provider_lease_id"]
    steered_controller.freeze(ks.namespace, name)
    ks.env.core.delete_namespaced_pod(name, ks.namespace, grace_period_seconds=60,
                                      _preload_content=False)
    ks.env.wait("pod", name, lambda p: p is not None and p["metadata"].get("deletionTimestamp"))
    try:
        checked = producer.check_resumable(acquired["lease_id"]).get(60)
        assert checked["resumable"] is False
        assert checked["reason"] == f"Pod {name} is terminating"
        assert ended(ks, acquired["lease_id"]) == LeaseState.DESTROYED
    finally:
        ks.env.core.delete_namespaced_pod(name, ks.namespace, grace_period_seconds=0,
                                          _preload_content=False)
    ks.env.wait("sandbox", name, gone)


def test_resume_403_propagates_and_leaves_the_lease_alone(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    ks.proxy.forbid("GET", rf"/sandboxes/{name}$", times=None)
    with pytest.raises(TerminalProviderError) as info:
        producer.check_resumable(acquired["lease_id"]).get(60)
    text = str(info.value)
    assert "HTTP 403" in text and 'add verb "get" on resource "sandboxes"' in text
    # an unexpected error is not an answer: the lease stays active, nothing was deleted
    assert ks.lease(acquired["lease_id"]).state == LeaseState.ACTIVE
    assert ks.proxy.count("DELETE") == 0
    assert ks.env.read("sandbox", name) is not None
    ks.proxy.clear_rules()
    assert producer.check_resumable(acquired["lease_id"]).get(60)["resumable"] is True


def test_resume_job_gone(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks, backend="job", command=LOOP)
    name = acquired["provider_lease_id"]
    ks.env.batch.delete_namespaced_job(name, ks.namespace, propagation_policy="Foreground",
                                       _preload_content=False)
    ks.env.wait("job", name, gone)
    assert not_resumable(ks, acquired["lease_id"]) == "Job no longer exists"


def test_resume_job_succeeded(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks, backend="job", command=["sh", "-c", "exit 0"])
    name = acquired["provider_lease_id"]
    ks.env.wait("job", name, condition_is("Complete"))
    assert not_resumable(ks, acquired["lease_id"]) == "Job is Succeeded"
    ks.env.wait("job", name, gone)


# -- destroy ----------------------------------------------------------------------------------

def test_destroy_when_everything_is_already_gone(kube_stack: KubeStack) -> None:
    ks = kube_stack
    acquired = acquire(ks)
    name = acquired["provider_lease_id"]
    ks.env.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes", name,
        propagation_policy="Foreground", _preload_content=False)
    for kind, obj in (("sandbox", name), ("pod", name), ("secret", f"{name}-env")):
        ks.env.wait(kind, obj, gone)
    ks.proxy.reset_counts()
    assert producer.destroy_lease(acquired["lease_id"]).get(60)["result"] == "destroyed"
    assert ks.lease(acquired["lease_id"]).state == LeaseState.DESTROYED
    # the workload and the Secret by their recorded uids, each a 404; the pods listed by
    # this lease's labels: none
    assert ks.proxy.count("DELETE") == 2 and ks.proxy.count("GET", r"/pods$") == 1
    events = ks.store.events(acquired["lease_id"])
    assert events[-1].reason == "destroyed (already_gone): requested"


@pytest.mark.parametrize("code", [403, 500])
def test_destroy_workload_failure_still_deletes_pod_and_secret(kube_stack: KubeStack,
                                                               code: int) -> None:
    # given a live lease whose Sandbox delete keeps failing
    ks = kube_stack
    acquired = acquire(ks)
    lease_id, name = acquired["lease_id"], acquired["provider_lease_id"]
    ks.proxy.fail("DELETE", rf"/sandboxes/{name}$", code, times=None)
    # when destroying; then the task fails with the workload's error, after deleting the pod
    # and the Secret; the lease waits in pending_cleanup, reachable
    with pytest.raises(DestroyIncomplete) as info:
        producer.destroy_lease(lease_id).get(60)
    assert f"HTTP {code}" in str(info.value) and "workload" in str(info.value)
    # a destroy never retries a provider failure itself: sweep.retry_cleanup does, said once
    assert "the task retries" not in str(info.value), info.value
    assert str(info.value).count("sweep.retry_cleanup will try again") == 1, info.value
    assert ks.proxy.count("DELETE", rf"/pods/{name}$") == 1
    assert ks.proxy.count("DELETE", rf"/secrets/{name}-env$") == 1
    ks.env.wait("secret", f"{name}-env", gone)
    assert ks.env.read("sandbox", name) is not None
    lease = ks.lease(lease_id)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 1
    assert lease.last_error is not None and f"HTTP {code}" in lease.last_error
    # and once the API server lets it, sweep.retry_cleanup finishes the destroy
    ks.proxy.clear_rules()
    app.send_task("sweep.retry_cleanup").get(60)
    assert ended(ks, lease_id) == LeaseState.DESTROYED
    ks.env.wait("sandbox", name, gone)


# -- acquire: partial failure -----------------------------------------------------------------

def test_acquire_secret_failure_destroys_the_workload(kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    first_error = Observe(ks.store).max_provider_error_id() + 1
    ks.proxy.fail("POST", r"/secrets$", 422, message=f"invalid value {SECRET}")
    with pytest.raises(TerminalProviderError, match="HTTP 422") as info:
        producer.acquire_lease(run_id, {"secret_env": {"API_KEY": SECRET}}).get(60)
    assert SECRET not in str(info.value)
    # one provider API error, with its class and HTTP status (the exporter's labels)
    assert [(e.provider, e.operation, e.task, e.error_class, e.status, e.error_type)
            for e in Observe(ks.store).provider_errors_from(first_error, 100)] == [
        ("kubernetes", "acquire", "lease.acquire", "terminal", 422, "TerminalProviderError")]
    (lease,) = ks.store.leases()
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_failed"
    assert ks.run(run_id).status == RunStatus.FAILED
    assert ks.proxy.count("POST", r"/sandboxes$") == 1
    ks.env.wait("sandbox", lease.provider_lease_id, gone)
    assert ks.env.read("secret", f"{lease.provider_lease_id}-env") is None
    assert SECRET not in ks.store_dump() and SECRET not in ks.worker_log()


def test_acquire_cleanup_failure_leaves_pending_cleanup_without_secrets(
        kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    ks.proxy.fail("POST", r"/secrets$", 422, message=f"invalid value {SECRET}")
    ks.proxy.fail("DELETE", r"/sandboxes/", 500, times=None)
    with pytest.raises(AcquireCleanupIncomplete) as info:
        producer.acquire_lease(run_id, {"secret_env": {"API_KEY": SECRET}}).get(60)
    (lease,) = ks.store.leases()
    text = str(info.value)
    assert f"acquisition of lease {lease.lease_id} failed and cleanup was incomplete" in text
    assert "HTTP 422" in text and "HTTP 500" in text
    assert text.count("cleanup was incomplete") == 1  # said once, not nested
    # what happens next is said once: no "will try again. ... will destroy what is left"
    assert text.count("sweep.retry_cleanup") == 1, text
    assert "the task retries" not in text, text
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.end_reason == "acquire_failed"
    assert ks.run(run_id).status == RunStatus.FAILED
    # the Sandbox is still there, and the store says so
    assert ks.env.read("sandbox", lease.provider_lease_id) is not None
    assert SECRET not in text and SECRET not in ks.store_dump()
    assert SECRET not in ks.worker_log()
    # once deletes work again, the lease's destroy removes it
    ks.proxy.clear_rules()
    assert producer.destroy_lease(lease.lease_id).get(60)["result"] == "destroyed"
    ks.env.wait("sandbox", lease.provider_lease_id, gone)


def test_a_job_whose_acquire_and_cleanup_failed_is_destroyed_as_a_job(
        kube_stack: KubeStack) -> None:
    # given a Job lease whose acquire failed after the Job existed and whose cleanup failed
    # too: it never became active, so no backend came back from the provider
    ks = kube_stack
    ks.proxy.fail("POST", r"/secrets$", 422)
    ks.proxy.fail("DELETE", r"/jobs/", 500, times=None)
    with pytest.raises(AcquireCleanupIncomplete):
        producer.acquire_lease(rid(), {"backend": "job", "command": LOOP}).get(60)
    (lease,) = ks.store.leases()
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.backend is None
    assert ks.env.read("job", lease.provider_lease_id) is not None
    # when deletes work again and the lease is destroyed
    ks.proxy.clear_rules()
    assert producer.destroy_lease(lease.lease_id).get(60)["result"] == "destroyed"
    # then its Job goes: it was looked for as the Job its spec asked for, not as a Sandbox
    ks.env.wait("job", lease.provider_lease_id, gone)
    assert ks.proxy.count("DELETE", r"/sandboxes/") == 0


# -- acquire: redelivery adopts what the first delivery created -------------------------------

def pool_children(parent: int) -> list[int]:
    """The pids of the worker's pool processes (children of its main process)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def test_acquire_redelivered_after_a_worker_crash_adopts_its_sandbox(
        kube_stack: KubeStack, steered_controller: Any) -> None:
    # given an acquire that created its Sandbox and Secret and waits for Ready
    ks = kube_stack
    steered_controller.never_ready(ks.namespace)
    run_id = rid()
    pending = producer.acquire_lease(run_id, {})
    secrets = eventually(lambda: ks.env.core.list_namespaced_secret(
        ks.namespace, label_selector="leasekeeper.dev/lease-id").items, "the Secret")
    name = secrets[0].metadata.labels["leasekeeper.dev/workload"]
    first_uid = ks.env.read("sandbox", name)["metadata"]["uid"]  # type: ignore[index]
    # when the pool process running it dies (acks_late + reject_on_worker_lost redeliver it)
    children = pool_children(ks.worker.pid)
    assert children
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    eventually(lambda: ks.proxy.count("POST", r"/sandboxes$") >= 2, "the redelivery")
    steered_controller.reset(ks.namespace)
    # then the second delivery adopts the same Sandbox and Secret: one of each
    result = pending.get(90)
    assert result["result"] == "adopted" and result["provider_lease_id"] == name
    lease = ks.lease(result["lease_id"])
    assert lease.state == LeaseState.ACTIVE and lease.provider_meta["uid"] == first_uid
    sandboxes = ks.env.custom.list_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", ks.namespace, "sandboxes")["items"]
    assert [s["metadata"]["uid"] for s in sandboxes] == [first_uid]
    secret = ks.env.read("secret", f"{name}-env")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == first_uid
    assert ks.proxy.count("POST", r"/secrets$") == 2  # the second one answered 409
    assert ks.proxy.count("GET", rf"/secrets/{name}-env$") == 1  # ... and was checked: ours
    assert producer.check_resumable(lease.lease_id).get(60)["resumable"] is True
    producer.destroy_lease(lease.lease_id).get(60)
    ks.env.wait("sandbox", name, gone)


# -- a Job's run ends with its real exit code -------------------------------------------------

@pytest.mark.parametrize(("code", "status"), [(7, RunStatus.FAILED), (0, RunStatus.COMPLETED)])
def test_job_run_finishes_with_its_exit_code_via_the_sweep(kube_stack: KubeStack, code: int,
                                                           status: RunStatus) -> None:
    # given a Job whose command exits by itself
    ks = kube_stack
    run_id = rid()
    acquired = acquire(ks, run_id, backend="job", command=["sh", "-c", f"exit {code}"])
    name = acquired["provider_lease_id"]
    ks.env.wait("job", name, condition_is("Failed" if code else "Complete"))
    assert ks.run(run_id).status == RunStatus.RUNNING
    # when the beat's sweep.finish_exited runs (no web backend call: nobody sends run.finish)
    summary = app.send_task("sweep.finish_exited").get(60)
    assert summary[status.value] == 1 and summary["reclaims_enqueued"] == 1
    assert f"{status.value} {run_id} (exit code {code})" in summary["items"]
    # then the run is finished with that exit code, and its sandbox is reclaimed
    run = eventually(lambda: (r := ks.run(run_id)).reclaim_outcome and r, "the reclaim")
    assert (run.status, run.exit_code) == (status, code)
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert ks.lease(acquired["lease_id"]).state == LeaseState.DESTROYED
    ks.env.wait("job", name, gone)
    assert ks.env.read("secret", f"{name}-env") is None
    # and a later tick finds nothing more to do
    again = app.send_task("sweep.finish_exited").get(60)
    assert (again["completed"], again["failed"], again["reclaims_enqueued"]) == (0, 0, 0)
