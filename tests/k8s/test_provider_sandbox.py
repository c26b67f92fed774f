"""Owns the integration tests of the Kubernetes provider's ``sandbox-cr`` backend against the
real API server: acquire, every resume-check outcome of the seed's checkLeaseResumable, and
errors that must propagate (403, 500)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from providers.base import AcquireOutcome, ResumeOutcome
from providers.errors import TerminalProviderError, TransientProviderError
from providers.kubernetes.manifests import LeaseIdentity, build_sandbox
from providers.kubernetes.provider import build_kubernetes_provider
from tests.cluster.waits import condition_is, gone, pod_phase_in
from tests.k8s.conftest import KubeEnv, provider_settings

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

META_KEYS = {"namespace", "pod_name", "secret_name", "secret_uid", "uid", "backend",
             "api_version"}


def test_acquire_creates_sandbox_and_owned_secret_and_resume_is_resumable(kenv: KubeEnv) -> None:
    # given a fresh lease; when acquiring it
    request = kenv.request(env={"GREETING": "hi"})
    acquired = kenv.provider.acquire(request)
    # then the Sandbox is Ready, its pod runs, and the Secret is owned by the Sandbox
    assert acquired.outcome is AcquireOutcome.CREATED
    assert acquired.backend == "sandbox-cr"
    assert set(acquired.meta) == META_KEYS
    assert acquired.meta["pod_name"] == request.name
    assert acquired.meta["secret_name"] == f"{request.name}-env"
    sandbox = kenv.read("sandbox", request.name)
    assert sandbox is not None and sandbox["metadata"]["uid"] == acquired.meta["uid"]
    labels = sandbox["metadata"]["labels"]
    assert labels["leasekeeper.dev/installation"] == kenv.installation
    assert labels["leasekeeper.dev/lease-id"] == request.lease_id
    assert labels["leasekeeper.dev/run-id"] == f"run-{request.lease_id}"
    assert labels["leasekeeper.dev/tenant"] == "acme"
    assert labels["app.kubernetes.io/managed-by"] == "leasekeeper"
    secret = kenv.read("secret", acquired.meta["secret_name"])
    assert secret is not None
    owner = secret["metadata"]["ownerReferences"][0]
    assert owner["uid"] == acquired.meta["uid"] and owner["controller"] is True
    assert owner["blockOwnerDeletion"] is True
    assert set(secret["data"]) == {"LEASEKEEPER_BOOTSTRAP_TOKEN"}
    pod = kenv.read("pod", acquired.meta["pod_name"])
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert pod["metadata"]["labels"]["leasekeeper.dev/role"] == "sandbox"
    # and when checking resume, it is resumable on that pod
    result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 10)
    assert result.outcome is ResumeOutcome.RESUMABLE
    assert result.details["pod_name"] == request.name
    assert result.details["phase"] == "Running"


def test_resume_sandbox_gone(kenv: KubeEnv) -> None:
    result = kenv.provider.resume_check(kenv.handle("lk-never-created"), 5)
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE
    assert result.reason == "Sandbox CR no longer exists"


def test_resume_sandbox_destroyed_is_gone(kenv: KubeEnv) -> None:
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    kenv.provider.destroy(kenv.handle(request.name, **acquired.meta))
    kenv.wait("sandbox", request.name, gone)
    result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 5)
    assert (result.outcome, result.reason) == (ResumeOutcome.NOT_RESUMABLE,
                                              "Sandbox CR no longer exists")


def test_resume_failed_sandbox_is_not_resumable_at_once(kenv: KubeEnv,
                                                        steered_controller: Any) -> None:
    # given a live lease whose Sandbox then reports its pod failed
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    steered_controller.mark_failed(kenv.namespace, request.name, "exit status 3")
    kenv.wait("sandbox", request.name, condition_is("Finished"))
    # when checking resume with a long wait; then it fails fast with the reason
    started = time.monotonic()
    result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 30)
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE
    assert "PodFailed" in result.reason and "exit status 3" in result.reason
    assert time.monotonic() - started < 5


def test_resume_never_ready_within_the_wait(kenv: KubeEnv, steered_controller: Any) -> None:
    # given a Sandbox whose pod never comes up
    steered_controller.never_ready(kenv.namespace)
    request = kenv.request(timeout_s=2)
    with pytest.raises(TransientProviderError, match="did not become Ready within 2s"):
        kenv.provider.acquire(request)
    # (acquire cleaned up after itself; recreate one the controller leaves unready)
    kenv.wait("sandbox", request.name, gone)
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme")
    kenv.create_sandbox(build_sandbox(identity, request.spec, kenv.provider.defaults,
                                      datetime.now(UTC)))
    # when checking resume with a 2 s wait; then it is not resumable after about 2 s
    started = time.monotonic()
    result = kenv.provider.resume_check(kenv.handle(request.name), 2)
    elapsed = time.monotonic() - started
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE
    assert "did not become Ready within 2s" in result.reason
    assert 1.5 < elapsed < 6


def _hand_made_pod(kenv: KubeEnv, name: str, command: list[str], sandbox: Any) -> None:
    """A pod named like the Sandbox and controlled by it, that the controller simulator does
    not watch (no sandbox-name-hash label): its deletion does not change the Sandbox's
    status, which is how a real controller's status lags a pod's deletion."""
    owner = {"apiVersion": sandbox["apiVersion"], "kind": "Sandbox", "name": name,
             "uid": sandbox["metadata"]["uid"], "controller": True}
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "hand-made"},
                         "ownerReferences": [owner]},
            "spec": {"terminationGracePeriodSeconds": 60,
                     "containers": [{"name": "sandbox", "image": "sim", "command": command}]}}
    kenv.core.create_namespaced_pod(kenv.namespace, body, _preload_content=False)
    kenv.wait("pod", name, lambda pod: pod_phase_in("Running")(pod) and condition_is("Ready")(pod))


def _ready_sandbox_with_hand_made_pod(kenv: KubeEnv, steered_controller: Any,
                                      command: list[str]) -> Any:
    # the lease's Sandbox first (the acquire adopts it), then its hand-made pod; the
    # controller, told again, reconciles it and mirrors that pod's Ready into the Sandbox
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme")
    sandbox = kenv.create_sandbox(build_sandbox(identity, request.spec, kenv.provider.defaults,
                                                datetime.now(UTC)))
    _hand_made_pod(kenv, request.name, command, sandbox)
    steered_controller.never_ready(kenv.namespace, request.name)
    acquired = kenv.provider.acquire(request)
    assert acquired.meta["pod_name"] == request.name
    return request, acquired


def test_resume_pod_gone_while_sandbox_still_ready(kenv: KubeEnv,
                                                   steered_controller: Any) -> None:
    request, acquired = _ready_sandbox_with_hand_made_pod(
        kenv, steered_controller, ["sh", "-c", "while :; do sleep 1; done"])
    kenv.core.delete_namespaced_pod(request.name, kenv.namespace, grace_period_seconds=0,
                                    _preload_content=False)
    kenv.wait("pod", request.name, gone)
    assert condition_is("Ready")(kenv.read("sandbox", request.name))
    result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 5)
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE
    assert result.reason == "Sandbox is Ready but no backing pod was found"


def test_resume_pod_terminating(kenv: KubeEnv, steered_controller: Any) -> None:
    # given a Ready Sandbox whose pod ignores SIGTERM, so its graceful deletion lingers
    request, acquired = _ready_sandbox_with_hand_made_pod(
        kenv, steered_controller, ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
    kenv.core.delete_namespaced_pod(request.name, kenv.namespace, _preload_content=False)
    kenv.wait("pod", request.name,
              lambda pod: pod is not None and pod["metadata"].get("deletionTimestamp"))
    try:
        result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 5)
        assert result.outcome is ResumeOutcome.NOT_RESUMABLE
        assert result.reason == f"Pod {request.name} is terminating"
    finally:
        kenv.core.delete_namespaced_pod(request.name, kenv.namespace, grace_period_seconds=0,
                                        _preload_content=False)


def test_resume_pod_named_by_the_sandbox_is_gone(kenv: KubeEnv, steered_controller: Any) -> None:
    # given a Sandbox whose status names its pod (status.podName), and that pod is gone
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    kenv.custom.patch_namespaced_custom_object_status(
        "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
        {"status": {"podName": "some-other-pod"}},
        _content_type="application/merge-patch+json", _preload_content=False)
    kenv.wait("sandbox", request.name,
              lambda sb: (sb or {}).get("status", {}).get("podName") == "some-other-pod")
    result = kenv.provider.resume_check(kenv.handle(request.name, **acquired.meta), 5)
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE
    assert result.reason == "Pod some-other-pod no longer exists"


def test_resume_403_propagates(kenv: KubeEnv) -> None:
    kenv.proxy.forbid("GET", r"/sandboxes/lk-forbidden$")
    with pytest.raises(TerminalProviderError, match="HTTP 403 Forbidden") as info:
        kenv.provider.resume_check(kenv.handle("lk-forbidden"), 5)
    assert "RBAC" in str(info.value)


def test_resume_500_propagates_as_transient(kenv: KubeEnv) -> None:
    kenv.proxy.fail("GET", r"/sandboxes/lk-broken$", 500)
    with pytest.raises(TransientProviderError, match="HTTP 500"):
        kenv.provider.resume_check(kenv.handle("lk-broken"), 5)


def test_resume_real_rbac_403_propagates(kube_cluster: Any, kenv: KubeEnv) -> None:
    # an identity with no RBAC grants at all, through the real authorizer
    if not hasattr(kube_cluster, "token_for"):
        pytest.skip("an external cluster has no static users")
    kubeconfig = kenv.proxy.kubeconfig_for_token(kube_cluster.token_for("alice"))
    nobody = build_kubernetes_provider(
        provider_settings(kubeconfig, kenv.namespace, kenv.installation))
    try:
        with pytest.raises(TerminalProviderError, match="HTTP 403"):
            nobody.resume_check(kenv.handle("lk-anything"), 5)
    finally:
        nobody.api.api_client.close()


def _in_background(steps: list[tuple[Callable[[], bool], Callable[[], None]]],
                   timeout_s: float = 30.0) -> threading.Thread:
    """Run each (wait until ``condition()``, then ``action()``) in order, in a thread, each
    wait under a monotonic deadline; the test joins the thread."""
    def run() -> None:
        for condition, action in steps:
            deadline = time.monotonic() + timeout_s
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.02)
            action()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _watches(kenv: KubeEnv) -> int:
    return kenv.proxy.count("GET", r"/sandboxes$", query="watch=true")


def test_watch_restarts_after_410_expired(kenv: KubeEnv, steered_controller: Any) -> None:
    # given a Sandbox held unready until the acquire's second watch, the first answered 410
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    kenv.proxy.fail("GET", r"/sandboxes$", 410, reason="Expired", query="watch=true",
                    message="too old resource version")
    helper = _in_background([(lambda: _watches(kenv) >= 2,
                              lambda: steered_controller.reset(kenv.namespace, request.name))])
    acquired = kenv.provider.acquire(request)
    helper.join()
    assert acquired.outcome is AcquireOutcome.CREATED
    # then it re-read the Sandbox once and watched again
    assert kenv.proxy.count("GET", rf"/sandboxes/{request.name}$") == 1
    assert _watches(kenv) == 2


def test_watch_resumes_after_the_connection_is_cut(kenv: KubeEnv,
                                                  steered_controller: Any) -> None:
    # given an acquire waiting on its watch, whose connection a proxy then cuts
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    helper = _in_background([
        (lambda: _watches(kenv) >= 1, kenv.proxy.close_streams),
        (lambda: _watches(kenv) >= 2,
         lambda: steered_controller.reset(kenv.namespace, request.name))])
    # when the Sandbox becomes Ready after that; then the acquire succeeds on a new watch
    # from the last resourceVersion, without re-reading the Sandbox
    acquired = kenv.provider.acquire(request)
    helper.join()
    assert acquired.outcome is AcquireOutcome.CREATED
    assert _watches(kenv) == 2
    assert kenv.proxy.count("GET", rf"/sandboxes/{request.name}$") == 0


def test_watch_that_keeps_failing_gives_up_transient(kenv: KubeEnv,
                                                    steered_controller: Any) -> None:
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    kenv.proxy.fail("GET", r"/sandboxes$", 503, query="watch=true", times=None)
    with pytest.raises(TransientProviderError, match="HTTP 503"):
        kenv.provider.acquire(request)
    assert _watches(kenv) == 3  # waits.MAX_BROKEN_WATCHES, then the task's retry policy
    kenv.wait("sandbox", request.name, gone)  # and the acquire cleaned up


def test_secret_is_readable_by_the_pod(kenv: KubeEnv, kubelet_sim: Any) -> None:
    if kubelet_sim is None:
        pytest.skip("needs the kubelet simulator to see the pod's environment")
    from pydantic import SecretStr

    request = kenv.request(secret_env={"API_KEY": SecretStr("s3cret")}, env={"A": "1"})
    acquired = kenv.provider.acquire(request)
    pod = kenv.read("pod", acquired.meta["pod_name"])
    assert pod is not None
    run = kubelet_sim.run_for(kenv.namespace, acquired.meta["pod_name"])
    assert run is not None
    env = run.envs["sandbox"]
    assert env["API_KEY"] == "s3cret" and env["A"] == "1"
    assert env["LEASEKEEPER_LEASE_ID"] == request.lease_id
    assert len(env["LEASEKEEPER_BOOTSTRAP_TOKEN"]) >= 32


def test_v1beta1_is_used_when_configured(kenv: KubeEnv, fault_proxy: Any) -> None:
    settings = provider_settings(fault_proxy.kubeconfig_path, kenv.namespace, kenv.installation,
                                 kube_sandbox_api_version="v1beta1")
    provider = build_kubernetes_provider(settings)
    try:
        request = kenv.request()
        acquired = provider.acquire(request)
        assert acquired.meta["api_version"] == "agents.x-k8s.io/v1beta1"
        assert fault_proxy.count("POST", r"/apis/agents.x-k8s.io/v1beta1/") == 1
        assert provider.resume_check(kenv.handle(request.name, **acquired.meta), 5).outcome \
            is ResumeOutcome.RESUMABLE
    finally:
        provider.api.api_client.close()
