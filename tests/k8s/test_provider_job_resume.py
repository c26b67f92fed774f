"""Owns the tests of a Job lease's resume check when its pod was replaced, against the real
API server, its Job controller and the kubelet simulator. Before, the check reported the
Job's phase (active>0: "Running") and never looked at the pod: a Job whose Secret was
deleted, its pod then replaced by one stuck on CreateContainerConfigError, was "resumable",
"Running". Now a pod that can never start is not resumable (in the words the Sandbox's
check uses for a pod), and a pod other than the one the acquire recorded (the Job
controller made another: the command started again) is reported as a restart."""

from __future__ import annotations

import time
from typing import Any

import pytest

from providers.base import ResumeOutcome
from tests.k8s.conftest import KubeEnv

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

SLEEP = ["sh", "-c", "sleep 600"]


def pods_of(kenv: KubeEnv, job: str) -> list[Any]:
    return list(kenv.core.list_namespaced_pod(kenv.namespace,
                                              label_selector=f"job-name={job}").items)


def a_pod(kenv: KubeEnv, job: str, ok: Any, what: str, timeout_s: float = 60.0) -> Any:
    """The first pod of Job ``job`` that ``ok`` accepts, polled under a monotonic deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [p for p in pods_of(kenv, job)
                 if p.metadata.deletion_timestamp is None and ok(p)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no pod of Job {job} {what}"
        time.sleep(0.1)


def waiting_reason(pod: Any) -> str | None:
    for status in pod.status.container_statuses or []:
        if status.state and status.state.waiting:
            return str(status.state.waiting.reason)
    return None


def running(pod: Any) -> bool:
    return pod.status.phase == "Running"


def delete_pod(kenv: KubeEnv, name: str) -> None:
    kenv.core.delete_namespaced_pod(name, kenv.namespace, grace_period_seconds=0,
                                    _preload_content=False)


def test_a_job_whose_new_pod_cannot_start_without_its_secret_is_not_resumable(
        kenv: KubeEnv) -> None:
    # given a Job lease whose pod runs
    request = kenv.request(backend="job", command=SLEEP)
    acquired = kenv.provider.acquire(request)
    first = a_pod(kenv, request.name, running, "Running").metadata.name
    # when an admin deletes its Secret, then its pod: the Job controller makes another,
    # which waits for the Secret for ever
    kenv.core.delete_namespaced_secret(f"{request.name}-env", kenv.namespace,
                                       _preload_content=False)
    delete_pod(kenv, first)
    stuck = a_pod(kenv, request.name,
                  lambda p: p.metadata.name != first
                  and waiting_reason(p) == "CreateContainerConfigError",
                  "waiting on CreateContainerConfigError").metadata.name
    result = kenv.provider.resume_check(kenv.handle(request.name, "job", **acquired.meta), 5)
    # then it is not resumable, and the reason says which pod and why
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE, result
    assert str(result.reason).startswith(f"Pod {stuck} is Pending (CreateContainerConfigError: "
                                         ), result
    assert f"{request.name}-env" in str(result.reason), result
    assert str(result.reason).endswith("it cannot start"), result


def test_a_job_whose_pod_was_replaced_is_resumable_and_says_the_command_restarted(
        kenv: KubeEnv) -> None:
    # given a Job lease whose pod runs, the one its acquire recorded
    request = kenv.request(backend="job", command=SLEEP)
    acquired = kenv.provider.acquire(request)
    first = a_pod(kenv, request.name, running, "Running").metadata.name
    assert acquired.meta["pod_name"] == first
    handle = kenv.handle(request.name, "job", **acquired.meta)
    assert kenv.provider.resume_check(handle, 5).details == {
        "pod_name": first, "phase": "Running", "namespace": kenv.namespace}
    # when its pod is deleted, and the Job controller runs the command again in another
    delete_pod(kenv, first)
    second = a_pod(kenv, request.name, lambda p: p.metadata.name != first and running(p),
                   "replacing it Running").metadata.name
    result = kenv.provider.resume_check(handle, 5)
    # then it is resumable (the sandbox runs), and the details say it was restarted
    assert result.outcome is ResumeOutcome.RESUMABLE, result
    assert result.details == {"pod_name": second, "phase": "Running",
                              "namespace": kenv.namespace, "restarted": True,
                              "recorded_pod_name": first}
