"""A Job whose pod the API server refuses, against the real API server and its Job
controller: the controller records FailedCreate on the Job and keeps the Job "active" with
no pod. Before, the acquire answered CREATED and the run had a lease on nothing, and the
resume check called it resumable. Now the acquire waits for the controller's word (an
Event on the Job) and fails, having removed the Job and its Secret: transient for a
used-up ResourceQuota (it frees up), terminal for a LimitRange, quoting the controller and
saying what to fix; and the resume check of such a Job says it is not resumable. A warm
pool's Job member, whose acquire waits for a Running pod, reads the same Events first: a
refused pod fails it at once, not at the acquire timeout."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest

from providers.base import AcquireOutcome, ResumeOutcome
from providers.errors import ProviderError, is_transient
from providers.kubernetes.provider import KubernetesProvider, build_kubernetes_provider
from tests.cluster.waits import gone
from tests.k8s.conftest import KubeEnv, provider_settings
from tests.k8s.test_provider_pools import pool_request

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

LOOP = ["sh", "-c", "while :; do sleep 1; done"]
# generous: the controller's first word comes within a second on a quiet machine, and the
# wait ends as soon as it comes
WAIT_S = 60.0


@pytest.fixture
def patient(kenv: KubeEnv) -> Iterator[KubernetesProvider]:
    """kenv's provider, but waiting up to WAIT_S for the Job controller's word."""
    provider = build_kubernetes_provider(provider_settings(
        kenv.proxy.kubeconfig_path, kenv.namespace, kenv.installation,
        kube_job_pod_wait_s=WAIT_S))
    yield provider
    provider.api.api_client.close()


def limit_cpu(kenv: KubeEnv, most: str) -> None:
    kenv.core.create_namespaced_limit_range(kenv.namespace, {
        "metadata": {"name": "small"},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": most}}]}})


def quota_no_pods(kenv: KubeEnv) -> None:
    kenv.core.create_namespaced_resource_quota(kenv.namespace, {
        "metadata": {"name": "none"}, "spec": {"hard": {"pods": "0"}}})
    # the quota controller fills in status.hard; until then admission cannot enforce it
    deadline = time.monotonic() + 60
    while not (json.loads(kenv.core.read_namespaced_resource_quota(
            "none", kenv.namespace, _preload_content=False).data).get("status") or {}).get(
                "hard"):
        assert time.monotonic() < deadline, "the quota controller never set status.hard"
        time.sleep(0.2)


def refused(kenv: KubeEnv, provider: KubernetesProvider) -> tuple[ProviderError, str]:
    request = kenv.request(backend="job", command=LOOP)
    with pytest.raises(ProviderError) as info:
        provider.acquire(request)
    return info.value, request.name


def test_a_job_whose_pod_a_limitrange_refuses_fails_terminal_and_leaves_nothing(
        kenv: KubeEnv, patient: KubernetesProvider) -> None:
    # given a namespace whose LimitRange allows less CPU than the sandbox's limit
    limit_cpu(kenv, "10m")
    # when a Job sandbox is acquired
    error, name = refused(kenv, patient)
    # then the acquire fails for good, quoting the controller and saying what to fix
    text = str(error)
    assert not is_transient(error), text
    assert f"could not create the pod of Job {name}" in text, text
    assert "maximum cpu usage per Container is 10m" in text, text
    assert "LimitRange" in text, text
    # and neither the Job nor its Secret is left behind
    kenv.wait("job", name, gone)
    kenv.wait("secret", f"{name}-env", gone)


def test_a_job_whose_pod_a_used_up_quota_refuses_fails_transient_and_leaves_nothing(
        kenv: KubeEnv, patient: KubernetesProvider) -> None:
    # given a namespace whose ResourceQuota allows no pod
    quota_no_pods(kenv)
    # when a Job sandbox is acquired
    error, name = refused(kenv, patient)
    # then the acquire fails, to be retried (a quota frees up), saying so
    text = str(error)
    assert is_transient(error), text
    assert "exceeded quota" in text, text
    assert "ResourceQuota is used up" in text, text
    kenv.wait("job", name, gone)
    kenv.wait("secret", f"{name}-env", gone)


def test_a_pool_job_member_whose_pod_a_limitrange_refuses_fails_at_once_and_leaves_nothing(
        kenv: KubeEnv, patient: KubernetesProvider) -> None:
    # given a namespace whose LimitRange allows less CPU than the sandbox's limit
    limit_cpu(kenv, "10m")
    # when a warm pool's Job member is provisioned (its acquire waits for a Running pod, up
    # to the whole acquire timeout)
    request = pool_request(kenv, "job", command=LOOP, timeout_s=WAIT_S)
    with pytest.raises(ProviderError) as info:
        patient.acquire(request)
    # then it fails for good on the controller's word, not transiently at the timeout
    text = str(info.value)
    assert not is_transient(info.value), text
    assert f"could not create the pod of Job {request.name}" in text, text
    assert "maximum cpu usage per Container is 10m" in text, text
    kenv.wait("job", request.name, gone)
    kenv.wait("secret", f"{request.name}-env", gone)


def test_a_job_whose_pod_was_refused_after_its_acquire_is_not_resumable(
        kenv: KubeEnv) -> None:
    # given a Job acquired by a provider that does not check the controller's word
    # (LEASEKEEPER_KUBE_JOB_POD_WAIT_S=0), in a namespace that refuses its pod
    hasty = build_kubernetes_provider(provider_settings(
        kenv.proxy.kubeconfig_path, kenv.namespace, kenv.installation,
        kube_job_pod_wait_s=0))
    try:
        limit_cpu(kenv, "10m")
        request = kenv.request(backend="job", command=LOOP)
        acquired = hasty.acquire(request)
        assert acquired.outcome is AcquireOutcome.CREATED
        job = kenv.read("job", request.name)
        assert job is not None
        uid = job["metadata"]["uid"]
        deadline = time.monotonic() + WAIT_S
        while not kenv.core.list_namespaced_event(
                kenv.namespace, field_selector=f"involvedObject.uid={uid},reason=FailedCreate"
                ).items:
            assert time.monotonic() < deadline, "the Job controller recorded no FailedCreate"
            time.sleep(0.2)
        # when its lease's sandbox is checked
        result = hasty.resume_check(kenv.handle(request.name, "job", **acquired.meta), 5)
        # then it is not resumable, and the reason quotes the refusal
        assert result.outcome is ResumeOutcome.NOT_RESUMABLE
        assert "was refused" in str(result.reason), result
        assert "maximum cpu usage per Container is 10m" in str(result.reason), result
    finally:
        hasty.api.api_client.close()


def test_a_job_whose_pod_is_made_is_acquired_as_before(
        kenv: KubeEnv, patient: KubernetesProvider) -> None:
    # given a LimitRange the sandbox fits in
    limit_cpu(kenv, "4")
    request = kenv.request(backend="job", command=LOOP)
    # when a Job sandbox is acquired; then it is, and its pod exists
    assert patient.acquire(request).outcome is AcquireOutcome.CREATED
    kenv.wait("job", request.name, lambda j: (j or {}).get("status", {}).get("active") == 1)


def test_a_worker_that_may_not_read_events_still_acquires_and_says_so_once(
        kenv: KubeEnv, patient: KubernetesProvider, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from providers.kubernetes import job_start

    monkeypatch.setattr(job_start._Said, "events_forbidden", False)
    # given an API server that refuses the worker's reads of Events (RBAC)
    message = ('events is forbidden: User "system:serviceaccount:x:leasekeeper" cannot list '
               'resource "events" in API group "" in the namespace "x"')
    kenv.proxy.forbid("GET", r"/events$", times=None, message=message)
    # when two Job sandboxes are acquired; then both are, as before this check existed
    with caplog.at_level(logging.WARNING, "leasekeeper.kubernetes"):
        for _ in range(2):
            request = kenv.request(backend="job", command=LOOP)
            assert patient.acquire(request).outcome is AcquireOutcome.CREATED
    # and the worker said once what to grant
    said = [r.getMessage() for r in caplog.records if "cannot read Events" in r.getMessage()]
    assert len(said) == 1, said
    assert "grant list and watch on events" in said[0]
