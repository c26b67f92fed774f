"""Owns the tests of a Sandbox whose pod the API server refuses by admission (403 ``pods
"x" is forbidden: ...``: a LimitRange, a used-up ResourceQuota), against the real API
server and the Sandbox controller simulator, which reports it as agent-sandbox does
(``Ready=False``, ``ReconcilerError``, the API server's answer quoted). Before, only a pod
refused as invalid (422) failed the acquire at once: a forbidden one waited out the acquire
timeout on every try of the task. Now it fails at once, in the words a Job's refused pod
gets (the API server's message, not its raw Status JSON, and what to fix)."""

from __future__ import annotations

import pytest

from providers.errors import ProviderError, is_transient
from tests.cluster.waits import gone
from tests.k8s.conftest import KubeEnv
from tests.k8s.test_provider_job_pod_refused import quota_no_pods

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

LOOP = ["sh", "-c", "while :; do sleep 1; done"]


def test_a_sandbox_whose_pod_a_limitrange_refuses_fails_terminal_and_leaves_nothing(
        kenv: KubeEnv) -> None:
    # given a namespace whose LimitRange allows less memory than the default limit (4Gi)
    kenv.core.create_namespaced_limit_range(kenv.namespace, {
        "metadata": {"name": "small"},
        "spec": {"limits": [{"type": "Container", "max": {"memory": "1Gi"}}]}})
    request = kenv.request(command=LOOP, timeout_s=40)
    # when a Sandbox is acquired
    with pytest.raises(ProviderError) as info:
        kenv.provider.acquire(request)
    # then it fails for good (not transiently at the acquire timeout), quoting the API
    # server's message and saying what to fix
    text = str(info.value)
    assert not is_transient(info.value), text
    assert f"could not create the pod of Sandbox {request.name}" in text, text
    assert "maximum memory usage per Container is 1Gi, but limit is 4Gi" in text, text
    assert "a LimitRange in the namespace refuses the pod's resources" in text, text
    assert '"kind"' not in text and "did not become Ready" not in text, text
    # and neither the Sandbox nor its Secret is left behind
    kenv.wait("sandbox", request.name, gone)
    kenv.wait("secret", f"{request.name}-env", gone)


def test_a_sandbox_whose_pod_a_used_up_quota_refuses_fails_at_once_as_a_job_does(
        kenv: KubeEnv) -> None:
    # given a namespace whose ResourceQuota allows no pod
    quota_no_pods(kenv)
    request = kenv.request(command=LOOP, timeout_s=40)
    # when a Sandbox is acquired; then it fails at once, to be retried (a quota frees up)
    with pytest.raises(ProviderError) as info:
        kenv.provider.acquire(request)
    text = str(info.value)
    assert is_transient(info.value), text
    assert f"could not create the pod of Sandbox {request.name}" in text, text
    assert "exceeded quota" in text and "ResourceQuota is used up" in text, text
    assert "did not become Ready" not in text, text
    kenv.wait("sandbox", request.name, gone)
