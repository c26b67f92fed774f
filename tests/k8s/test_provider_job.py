"""Owns the integration tests of the Kubernetes provider's ``job`` backend against the real
API server, its Job controller and the kubelet simulator: acquire, resume-check outcomes
(running, gone, Succeeded, Failed) and ``job_exit``."""

from __future__ import annotations

import pytest

from providers.base import AcquireOutcome, ResumeOutcome
from providers.kubernetes.status import JobPhase
from tests.cluster.waits import condition_is, gone
from tests.k8s.conftest import KubeEnv

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]


def test_job_acquire_and_running_job_is_resumable(kenv: KubeEnv) -> None:
    request = kenv.request(backend="job", command=["sh", "-c", "while :; do sleep 1; done"])
    acquired = kenv.provider.acquire(request)
    assert acquired.outcome is AcquireOutcome.CREATED and acquired.backend == "job"
    job = kenv.read("job", request.name)
    assert job is not None
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    secret = kenv.read("secret", f"{request.name}-env")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    kenv.wait("job", request.name, lambda j: (j or {}).get("status", {}).get("active") == 1)
    result = kenv.provider.resume_check(kenv.handle(request.name, "job", **acquired.meta), 5)
    assert result.outcome is ResumeOutcome.RESUMABLE
    assert result.details["phase"] in ("Pending", "Running")
    pod_name = result.details["pod_name"]
    assert pod_name is None or pod_name.startswith(f"{request.name}-")
    assert kenv.provider.job_exit(kenv.handle(request.name, "job")).phase in (
        JobPhase.PENDING, JobPhase.RUNNING)


def test_job_gone_is_not_resumable(kenv: KubeEnv) -> None:
    request = kenv.request(backend="job", command=["sh", "-c", "sleep 30"])
    acquired = kenv.provider.acquire(request)
    kenv.provider.destroy(kenv.handle(request.name, "job", **acquired.meta))
    kenv.wait("job", request.name, gone)
    result = kenv.provider.resume_check(kenv.handle(request.name, "job"), 5)
    assert (result.outcome, result.reason) == (ResumeOutcome.NOT_RESUMABLE,
                                              "Job no longer exists")
    assert kenv.provider.job_exit(kenv.handle(request.name, "job")) == (JobPhase.GONE, None)


@pytest.mark.parametrize(("script", "phase", "condition", "code"), [
    ("exit 0", JobPhase.SUCCEEDED, "Complete", 0),
    ("exit 3", JobPhase.FAILED, "Failed", 3),
])
def test_finished_job_is_not_resumable_and_reports_its_exit(
        kenv: KubeEnv, script: str, phase: JobPhase, condition: str, code: int) -> None:
    request = kenv.request(backend="job", command=["sh", "-c", script])
    kenv.provider.acquire(request)
    kenv.wait("job", request.name, condition_is(condition))
    result = kenv.provider.resume_check(kenv.handle(request.name, "job"), 5)
    assert (result.outcome, result.reason) == (ResumeOutcome.NOT_RESUMABLE,
                                              f"Job is {phase.value}")
    # and it says how the command ended, so the check records the run as the sweep does
    assert (result.exit_code, result.exit_reason) == (code, None)
    assert kenv.provider.job_exit(kenv.handle(request.name, "job")) == (phase, code)


def test_a_job_killed_by_its_deadline_is_not_resumable_and_reports_why(kenv: KubeEnv) -> None:
    # its run is then recorded as sweep.finish_exited records it: failed, no exit code
    request = kenv.request(backend="job", command=["sh", "-c", "while :; do sleep 1; done"],
                           ttl_s=1)
    kenv.provider.acquire(request)
    kenv.wait("job", request.name, lambda job: any(
        c.get("type") == "Failed" and c.get("reason") == "DeadlineExceeded"
        for c in (job or {}).get("status", {}).get("conditions") or []))
    result = kenv.provider.resume_check(kenv.handle(request.name, "job"), 5)
    assert (result.outcome, result.reason) == (ResumeOutcome.NOT_RESUMABLE, "Job is Failed")
    assert (result.exit_code, result.exit_reason) == (None, "DeadlineExceeded")


def test_list_managed_reports_finished_jobs_exit_codes_in_four_requests(
        kenv: KubeEnv) -> None:
    # given a Job that exited 7, one that exited 0, one still running, and a Sandbox
    failed = kenv.request(backend="job", command=["sh", "-c", "exit 7"])
    succeeded = kenv.request(backend="job", command=["sh", "-c", "exit 0"])
    running = kenv.request(backend="job", command=["sh", "-c", "while :; do sleep 1; done"])
    sandbox = kenv.request()
    for request in (failed, succeeded, running, sandbox):
        kenv.provider.acquire(request)
    kenv.wait("job", failed.name, condition_is("Failed"))
    kenv.wait("job", succeeded.name, condition_is("Complete"))
    kenv.wait("job", running.name, lambda j: (j or {}).get("status", {}).get("active") == 1)
    # when listing; then each finished Job carries its container's exit code, from the pods
    # the listing reads anyway
    kenv.proxy.reset_counts()
    found = {r.name: r for r in kenv.provider.list_managed()}
    assert kenv.proxy.count() == 4
    assert found[failed.name].exit_code == 7
    assert found[succeeded.name].exit_code == 0
    assert found[running.name].exit_code is None
    assert found[sandbox.name].exit_code is None
    assert found[failed.name].lease_id == failed.lease_id
    assert found[failed.name].meta["pod_name"].startswith(f"{failed.name}-")
