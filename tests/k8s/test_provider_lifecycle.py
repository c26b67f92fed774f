"""Owns the integration tests of the Kubernetes provider's destroy, partial-failure cleanup,
adoption on 409, list_managed and the number of API requests per operation, against the real
API server with faults injected by the proxy in front of it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import SecretStr

from providers.base import AcquireOutcome, DestroyOutcome, ResumeOutcome
from providers.errors import (
    AcquireCleanupIncomplete,
    DestroyIncomplete,
    ProviderConflict,
    TerminalProviderError,
    TransientProviderError,
    is_transient,
)
from providers.kubernetes.manifests import LeaseIdentity, build_sandbox
from providers.kubernetes.provider import KubernetesProvider
from tests.cluster.waits import gone
from tests.k8s.conftest import KubeEnv

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
SECRET_VALUE = "s3cret-value-never-logged"
TOKEN = "bootstrap-token-never-logged"


def with_token(kenv: KubeEnv) -> KubernetesProvider:
    p = kenv.provider
    return KubernetesProvider(p.api, p.defaults, p.installation, p.default_backend,
                              token_factory=lambda: TOKEN)


# -- destroy ----------------------------------------------------------------------------------

def test_destroy_everything_404_is_already_gone(kenv: KubeEnv) -> None:
    for backend in ("sandbox-cr", "job"):
        handle = kenv.handle(f"lk-nothing-{backend}", backend, uid="0000",
                             pod_name="lk-nothing-pod", secret_name="lk-nothing-env")
        assert kenv.provider.destroy(handle) is DestroyOutcome.ALREADY_GONE


def test_destroy_deletes_all_parts_and_is_idempotent(kenv: KubeEnv) -> None:
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    handle = kenv.handle(request.name, **acquired.meta)
    assert kenv.provider.destroy(handle) is DestroyOutcome.DESTROYED
    assert kenv.proxy.count("DELETE", rf"/sandboxes/{request.name}$") == 1
    assert kenv.proxy.count("DELETE", rf"/pods/{request.name}$") == 1
    assert kenv.proxy.count("DELETE", rf"/secrets/{request.name}-env$") == 1
    kenv.wait("sandbox", request.name, gone)
    kenv.wait("pod", request.name, gone)
    assert kenv.read("secret", f"{request.name}-env") is None
    assert kenv.provider.destroy(handle) is DestroyOutcome.ALREADY_GONE


def test_destroy_workload_500_still_deletes_pod_and_secret(kenv: KubeEnv) -> None:
    # given a live lease, and the Sandbox delete answering 500 once
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    handle = kenv.handle(request.name, **acquired.meta)
    kenv.proxy.fail("DELETE", rf"/sandboxes/{request.name}$", 500)
    # when destroying; then the failure is reported, transient, after pod and Secret deletes
    with pytest.raises(DestroyIncomplete) as info:
        kenv.provider.destroy(handle)
    assert [f.part for f in info.value.failures] == ["workload"]
    assert isinstance(info.value.failures[0].error, TransientProviderError)
    assert is_transient(info.value)
    assert "HTTP 500" in str(info.value)
    assert kenv.proxy.count("DELETE", rf"/pods/{request.name}$") == 1
    assert kenv.proxy.count("DELETE", rf"/secrets/{request.name}-env$") == 1
    assert kenv.read("secret", f"{request.name}-env") is None
    # and a retry finishes the job
    assert kenv.provider.destroy(handle) is DestroyOutcome.DESTROYED
    kenv.wait("sandbox", request.name, gone)


def test_destroy_deletes_the_pod_that_holds_the_name_when_the_listed_one_was_replaced(
        kenv: KubeEnv) -> None:
    # given a live lease whose pod's delete answers 409 once, as when its controller made
    # the pod again under the same name between the destroy's list and its delete (the uid
    # precondition names the listed incarnation)
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    kenv.proxy.fail("DELETE", rf"/pods/{request.name}$", 409, reason="Conflict",
                    message="Precondition failed: UID in precondition: x, UID in object meta: y")
    # when destroying; then the pod holding the name now is read and deleted: no failure
    assert kenv.provider.destroy(kenv.handle(request.name, **acquired.meta)) is (
        DestroyOutcome.DESTROYED)
    # (read again after the 409; deleted then, unless the Sandbox's deletion took it first)
    assert kenv.proxy.count("GET", rf"/pods/{request.name}$") == 1
    kenv.wait("sandbox", request.name, gone)
    kenv.wait("pod", request.name, gone)


def test_destroy_reports_every_failed_part_together(kenv: KubeEnv) -> None:
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    kenv.proxy.forbid("DELETE", rf"/sandboxes/{request.name}$")
    kenv.proxy.fail("DELETE", rf"/secrets/{request.name}-env$", 503)
    with pytest.raises(DestroyIncomplete) as info:
        kenv.provider.destroy(kenv.handle(request.name, **acquired.meta))
    parts = {f.part: f.error for f in info.value.failures}
    assert set(parts) == {"workload", "secret"}
    assert isinstance(parts["workload"], TerminalProviderError)
    assert "403" in str(parts["workload"])
    assert isinstance(parts["secret"], TransientProviderError)
    assert not is_transient(info.value)
    assert kenv.proxy.count("DELETE", rf"/pods/{request.name}$") == 1


def test_destroy_without_uid_leaves_someone_elses_object(kenv: KubeEnv) -> None:
    # given a Sandbox of the same name from another installation
    identity = LeaseIdentity("their-lease", "lk-theirs", "someone-else", "acme")
    kenv.create_sandbox(build_sandbox(identity, kenv.request().spec, kenv.provider.defaults,
                                      datetime.now(UTC)))
    # when destroying by name only; then nothing is deleted
    assert kenv.provider.destroy(kenv.handle("lk-theirs")) is DestroyOutcome.ALREADY_GONE
    assert kenv.proxy.count("DELETE") == 0
    assert kenv.read("sandbox", "lk-theirs") is not None


def test_destroy_by_name_alone_leaves_someone_elses_pod_and_secret(kenv: KubeEnv) -> None:
    # given no workload, and someone else's pod and Secret under the names a Sandbox lease
    # named lk-theirs-3 would derive (its pod, its <name>-env)
    kenv.core.create_namespaced_pod(kenv.namespace, {
        "metadata": {"name": "lk-theirs-3", "labels": {"app": "someone-else"}},
        "spec": {"containers": [{"name": "c", "image": "busybox",
                                 "command": ["sh", "-c", "while :; do sleep 1; done"]}]}})
    kenv.core.create_namespaced_secret(kenv.namespace, {
        "metadata": {"name": "lk-theirs-3-env"}, "stringData": {"THEIRS": "x"}})
    # when destroying by name only (a lease whose acquire never recorded anything)
    for backend in ("sandbox-cr", "job"):
        assert kenv.provider.destroy(kenv.handle("lk-theirs-3", backend)) \
            is DestroyOutcome.ALREADY_GONE
    # then nothing is deleted: neither is labelled as this installation's lk-theirs-3
    assert kenv.proxy.count("DELETE") == 0
    assert kenv.read("pod", "lk-theirs-3") is not None
    assert kenv.read("secret", "lk-theirs-3-env") is not None


def test_destroy_with_a_stale_uid_deletes_the_leases_later_incarnation(kenv: KubeEnv) -> None:
    # given a lease whose recorded uid is of a Sandbox that is gone, and a later incarnation
    # of it under its name (an acquire that raced the destroy, or whose create answer was
    # lost and landed late, made it after the store recorded the first uid)
    request = kenv.request()
    first = kenv.provider.acquire(request)
    kenv.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
        propagation_policy="Foreground", _preload_content=False)
    kenv.wait("sandbox", request.name, gone)
    second = kenv.provider.acquire(request)
    assert second.meta["uid"] != first.meta["uid"]
    # when destroying with the metadata recorded first
    outcome = kenv.provider.destroy(kenv.handle(request.name, **first.meta))
    # then the later incarnation goes, pod and Secret too: it is this lease's, by its labels
    assert outcome is DestroyOutcome.DESTROYED
    kenv.wait("sandbox", request.name, gone)
    kenv.wait("pod", request.name, gone)
    assert kenv.read("secret", f"{request.name}-env") is None


def test_destroy_with_a_stale_uid_leaves_someone_elses_object(kenv: KubeEnv) -> None:
    # given our lease's recorded uid, and another installation's Sandbox under its name
    identity = LeaseIdentity("their-lease", "lk-theirs-2", "someone-else", "acme")
    kenv.create_sandbox(build_sandbox(identity, kenv.request().spec, kenv.provider.defaults,
                                      datetime.now(UTC)))
    # when destroying with our stale uid; then their Sandbox, pod and Secret are left alone
    handle = kenv.handle("lk-theirs-2", uid="00000000-0000-0000-0000-000000000000")
    assert kenv.provider.destroy(handle) is DestroyOutcome.ALREADY_GONE
    assert kenv.proxy.count("DELETE", r"/(pods|secrets)/") == 0
    assert kenv.read("sandbox", "lk-theirs-2") is not None


# -- acquire: partial failure and adoption ----------------------------------------------------

def test_acquire_secret_failure_destroys_the_workload(kenv: KubeEnv) -> None:
    # given the Secret create failing after the Sandbox exists
    kenv.proxy.fail("POST", r"/secrets$", 500)
    request = kenv.request(secret_env={"API_KEY": SecretStr(SECRET_VALUE)})
    # when acquiring; then the original error propagates and the Sandbox is destroyed
    with pytest.raises(TransientProviderError, match="HTTP 500") as info:
        with_token(kenv).acquire(request)
    assert not isinstance(info.value, AcquireCleanupIncomplete)
    assert kenv.proxy.count("DELETE", rf"/sandboxes/{request.name}$") == 1
    kenv.wait("sandbox", request.name, gone)
    assert kenv.read("secret", f"{request.name}-env") is None


def test_acquire_cleanup_failure_is_reported_without_secrets(kenv: KubeEnv) -> None:
    kenv.proxy.fail("POST", r"/secrets$", 422, message=f"echo {SECRET_VALUE} {TOKEN}")
    kenv.proxy.fail("DELETE", r"/sandboxes/", 500)
    request = kenv.request(secret_env={"API_KEY": SecretStr(SECRET_VALUE)})
    with pytest.raises(AcquireCleanupIncomplete) as info:
        with_token(kenv).acquire(request)
    text = str(info.value)
    assert "cleanup was incomplete" in text and request.lease_id in text
    assert "HTTP 422" in text and "HTTP 500" in text
    assert SECRET_VALUE not in text and TOKEN not in text
    assert info.value.__cause__ is not None and SECRET_VALUE not in repr(info.value.__cause__)
    # the Sandbox is still there for sweep.retry_cleanup
    assert kenv.read("sandbox", request.name) is not None
    assert kenv.provider.destroy(kenv.handle(request.name)) is DestroyOutcome.DESTROYED


def test_acquire_ready_wait_failure_destroys_the_workload(kenv: KubeEnv,
                                                         steered_controller: Any) -> None:
    request = kenv.request(timeout_s=30)
    steered_controller.mark_failed(kenv.namespace, request.name, "image pull failed")
    with pytest.raises(TerminalProviderError, match="PodFailed"):
        kenv.provider.acquire(request)
    kenv.wait("sandbox", request.name, gone)


def test_acquire_429_on_create_leaves_nothing(kenv: KubeEnv) -> None:
    kenv.proxy.throttle("POST", r"/sandboxes$")
    request = kenv.request()
    with pytest.raises(TransientProviderError, match="429"):
        kenv.provider.acquire(request)
    assert kenv.proxy.count("DELETE") == 0
    assert kenv.read("sandbox", request.name) is None


@pytest.mark.parametrize("backend", ["sandbox-cr", "job"])
def test_acquire_again_adopts_our_own_objects(kenv: KubeEnv, backend: str) -> None:
    request = kenv.request(backend=backend, command=["sh", "-c", "while :; do sleep 1; done"])
    first = kenv.provider.acquire(request)
    second = kenv.provider.acquire(request)
    assert first.outcome is AcquireOutcome.CREATED
    assert second.outcome is AcquireOutcome.ADOPTED
    assert second.meta["uid"] == first.meta["uid"]
    secret = kenv.read("secret", f"{request.name}-env")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == first.meta["uid"]


def test_acquire_refuses_someone_elses_sandbox(kenv: KubeEnv) -> None:
    request = kenv.request()
    identity = LeaseIdentity(request.lease_id, request.name, "another-installation", "acme")
    kenv.create_sandbox(build_sandbox(identity, request.spec, kenv.provider.defaults,
                                      datetime.now(UTC)))
    with pytest.raises(ProviderConflict, match="refusing to adopt"):
        kenv.provider.acquire(request)
    assert kenv.proxy.count("DELETE") == 0
    assert kenv.read("sandbox", request.name) is not None
    assert kenv.read("secret", f"{request.name}-env") is None


def test_acquire_refuses_someone_elses_secret(kenv: KubeEnv) -> None:
    request = kenv.request()
    kenv.core.create_namespaced_secret(
        kenv.namespace, {"metadata": {"name": f"{request.name}-env"}, "stringData": {"k": "v"}},
        _preload_content=False)
    with pytest.raises(ProviderConflict, match="Secret"):
        kenv.provider.acquire(request)
    # the Sandbox it created is destroyed; the foreign Secret is left alone
    kenv.wait("sandbox", request.name, gone)
    assert kenv.read("secret", f"{request.name}-env") is not None


# -- enumerate --------------------------------------------------------------------------------

def test_list_managed_finds_this_installations_workloads_only(kenv: KubeEnv) -> None:
    sandbox = kenv.request()
    job = kenv.request(backend="job", command=["sh", "-c", "sleep 30"])
    kenv.provider.acquire(sandbox)
    kenv.provider.acquire(job)
    foreign = LeaseIdentity("x", "lk-foreign", "someone-else", "acme")
    kenv.create_sandbox(build_sandbox(foreign, sandbox.spec, kenv.provider.defaults,
                                      datetime.now(UTC)))
    found = {r.name: r for r in kenv.provider.list_managed()}
    assert set(found) == {sandbox.name, job.name}
    assert found[sandbox.name].backend == "sandbox-cr"
    assert found[sandbox.name].lease_id == sandbox.lease_id
    assert found[job.name].backend == "job" and found[job.name].lease_id == job.lease_id
    assert found[sandbox.name].created_at is not None
    assert found[sandbox.name].meta["uid"]
    # a handle from a listing destroys it
    listed = found[sandbox.name]
    assert kenv.provider.destroy(kenv.handle(listed.name, listed.backend, **listed.meta)) \
        is DestroyOutcome.DESTROYED


def test_list_managed_marks_a_workload_stuck_terminating_past_the_limit(kenv: KubeEnv) -> None:
    # given a Sandbox whose deletion began and cannot finish (a finalizer holds it)
    request = kenv.request()
    kenv.provider.acquire(request)
    hold = "test.leasekeeper.dev/hold"
    kenv.custom.patch_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
        {"metadata": {"finalizers": [hold]}})
    kenv.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
        _preload_content=False)
    try:
        kenv.wait("sandbox", request.name,
                  lambda sb: bool(sb and sb["metadata"].get("deletionTimestamp")))
        p = kenv.provider
        assert p.terminating_limit_s == 600.0

        def listed(seconds_later: float) -> dict[str, Any]:
            at = datetime.now(UTC) + timedelta(seconds=seconds_later)
            clocked = KubernetesProvider(p.api, p.defaults, p.installation, p.default_backend,
                                         terminating_limit_s=600.0, now=lambda: at)
            return {r.name: r.meta for r in clocked.list_managed()}[request.name]

        # then it is terminating, since its deletionTimestamp; stuck only past the limit
        now = listed(0)
        assert now["terminating"] is True and now["stuck_terminating"] is False
        assert datetime.fromisoformat(now["terminating_since"]) <= datetime.now(UTC)
        assert listed(601)["stuck_terminating"] is True
    finally:
        kenv.custom.patch_namespaced_custom_object(
            "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
            {"metadata": {"finalizers": None}})
    kenv.wait("sandbox", request.name, gone)


def test_list_managed_reports_an_orphaned_secret(kenv: KubeEnv) -> None:
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    # the Sandbox is deleted orphaning its dependents (a broken controller or a careless admin)
    kenv.custom.delete_namespaced_custom_object(
        "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", request.name,
        body={"propagationPolicy": "Orphan"}, _preload_content=False)
    kenv.wait("sandbox", request.name, gone)
    found = {r.name: r for r in kenv.provider.list_managed()}
    assert found[request.name].meta.get("orphaned") is True
    assert found[request.name].lease_id == request.lease_id
    assert kenv.provider.destroy(kenv.handle(request.name, **{
        k: v for k, v in acquired.meta.items() if k != "uid"})) is DestroyOutcome.DESTROYED
    assert kenv.read("secret", f"{request.name}-env") is None


# -- request counts ---------------------------------------------------------------------------

def test_request_counts_per_operation(kenv: KubeEnv, capsys: pytest.CaptureFixture[str]) -> None:
    counts: dict[str, int] = {}
    request = kenv.request()
    kenv.proxy.reset_counts()
    acquired = kenv.provider.acquire(request)
    counts["acquire sandbox-cr"] = kenv.proxy.count()
    handle = kenv.handle(request.name, **acquired.meta)
    kenv.proxy.reset_counts()
    assert kenv.provider.resume_check(handle, 10).outcome is ResumeOutcome.RESUMABLE
    counts["resume_check live sandbox-cr"] = kenv.proxy.count()
    kenv.proxy.reset_counts()
    kenv.provider.destroy(handle)
    counts["destroy sandbox-cr"] = kenv.proxy.count()

    job = kenv.request(backend="job", command=["sh", "-c", "while :; do sleep 1; done"])
    kenv.proxy.reset_counts()
    job_acquired = kenv.provider.acquire(job)
    counts["acquire job"] = kenv.proxy.count()
    job_handle = kenv.handle(job.name, "job", **job_acquired.meta)
    kenv.wait("job", job.name, lambda j: (j or {}).get("status", {}).get("active") == 1)
    kenv.proxy.reset_counts()
    assert kenv.provider.resume_check(job_handle, 10).outcome is ResumeOutcome.RESUMABLE
    counts["resume_check live job"] = kenv.proxy.count()
    kenv.proxy.reset_counts()
    kenv.provider.destroy(job_handle)
    counts["destroy job"] = kenv.proxy.count()
    kenv.proxy.reset_counts()
    kenv.provider.list_managed()
    counts["list_managed"] = kenv.proxy.count()

    with capsys.disabled():
        print("\nAPI requests per operation:", counts)
    # create Sandbox, create Secret, one watch (the pod is named by the Ready Sandbox)
    assert counts["acquire sandbox-cr"] == 3
    # read Sandbox, read pod
    assert counts["resume_check live sandbox-cr"] == 2
    # delete the workload (Foreground, by uid), list its pods by label, delete the pod (by
    # uid: a stuck GC would keep it running), delete the Secret (by uid)
    assert counts["destroy sandbox-cr"] == 4
    # create Job, create Secret, list the Job's Events (and watch them while the Job
    # controller has not yet said whether it made the pod)
    assert counts["acquire job"] in (3, 4)
    # read Job, list pods; and the Secret, when the pod still waits on it (made before
    # acquire created the Secret, it shows CreateContainerConfigError for a moment)
    assert counts["resume_check live job"] in (2, 3)
    assert counts["destroy job"] == 4
    assert counts["list_managed"] == 4
