"""Owns the integration tests of "objects that are not ours", against the real API server, its
controllers (Job, Deployment, garbage collector), the Sandbox controller simulator and the
kubelet simulator, with the foreign objects made directly by the admin client:
- a workload under the lease's name that is not the one acquire recorded (another
  installation's, made after ours was deleted) is gone for ``resume_check`` and refused by a
  warm-pool ``claim`` (no exec: the run's data, secrets included, never reaches it);
- an object another controller owns (a user's Deployment whose pod template copied our
  labels) is never deleted by ``destroy`` nor listed by ``list_managed`` as an orphan;
- a pod counts for a workload only if the workload controls it: a bare pod labelled
  ``job-name=<our Job>`` is never named by ``resume_check``, and its exit code is never the
  Job's; a Sandbox whose ``status.podName`` names a pod not its own is inconsistent: not
  resumable, and a claim delivers the run's data into no pod (neither that one nor the
  Sandbox's own);
- a Secret under the lease's Secret name that another controller owns is never adopted,
  replaced nor deleted (acquire refuses it, naming its controller; its cleanup leaves it);
- a Sandbox made under the lease's name by someone else while a wait on the lease's went on
  (the watch answered 410, so no DELETED event is seen) is never taken for the lease's.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from kubernetes import client

from providers.base import ClaimOutcome, LeaseHandle, ResumeOutcome
from providers.errors import ProviderConflict, TransientProviderError
from providers.kubernetes.manifests import (
    Backend,
    LeaseIdentity,
    OwnerRef,
    build_job,
    build_sandbox,
    build_secret,
)
from providers.kubernetes.status import JobPhase
from providers.spec import SandboxSpec
from tests.cluster.fault_proxy import Rule
from tests.cluster.waits import condition_is, gone, pod_phase_in
from tests.k8s.conftest import GROUP, PLURAL, KubeEnv
from tests.k8s.test_provider_pools import claim_request, member, new_secret

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

LOOP = ["sh", "-c", "while :; do sleep 1; done"]
BACKENDS = ["sandbox-cr", "job"]
KIND = {"sandbox-cr": "sandbox", "job": "job"}
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, timeout_s: float = 60.0) -> T:
    """probe()'s first truthy value, under a monotonic deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def pods_of(kenv: KubeEnv, selector: str) -> list[dict[str, Any]]:
    listed = json.loads(kenv.core.list_namespaced_pod(
        kenv.namespace, label_selector=selector, _preload_content=False).data)
    return list(listed["items"])


def some_pod(kenv: KubeEnv, selector: str,
             predicate: Callable[[dict[str, Any] | None], bool]) -> dict[str, Any]:
    return eventually(lambda: next((p for p in pods_of(kenv, selector) if predicate(p)), None),
                      f"a pod {selector} to be as expected")


def no_pods(kenv: KubeEnv, selector: str) -> None:
    eventually(lambda: not pods_of(kenv, selector), f"every pod {selector} to be gone")


def their_workload(kenv: KubeEnv, backend: str, name: str) -> dict[str, Any]:
    """Another installation's workload (and the Secret its pod reads) under ``name``,
    running; returns it."""
    identity = LeaseIdentity("their-lease", name, "someone-else", "acme")
    kenv.wait("secret", f"{name}-env", gone)
    kenv.core.create_namespaced_secret(kenv.namespace, {
        "metadata": {"name": f"{name}-env", "labels": {"app": "someone-else"}},
        "stringData": {"THEIRS": "their-value"}}, _preload_content=False)
    spec = SandboxSpec(tenant="acme", command=LOOP)
    if backend == "job":
        kenv.batch.create_namespaced_job(
            kenv.namespace, build_job(identity, spec, kenv.provider.defaults),
            _preload_content=False)
        found = kenv.wait("job", name,
                          lambda j: (j or {}).get("status", {}).get("active") == 1)
        some_pod(kenv, f"job-name={name}", pod_phase_in("Running"))
    else:
        kenv.create_sandbox(build_sandbox(identity, spec, kenv.provider.defaults,
                                          datetime.now(UTC)))
        found = kenv.wait("sandbox", name, condition_is("Ready"))
    assert found is not None
    return found


def ours_then_theirs(kenv: KubeEnv, backend: str, handle: LeaseHandle) -> dict[str, Any]:
    """Delete the lease's workload (and wait until it and its pods are gone), then another
    installation makes its own under the same name."""
    kenv.provider.destroy(handle)
    kenv.wait(KIND[backend], handle.name, gone)
    selector = (f"job-name={handle.name}" if backend == "job"
                else f"leasekeeper.dev/workload={handle.name}")
    no_pods(kenv, selector)
    return their_workload(kenv, backend, handle.name)


def bare_pod(kenv: KubeEnv, name: str, labels: dict[str, str], script: str) -> None:
    """A pod made by hand (no ownerReferences), running ``script``."""
    kenv.core.create_namespaced_pod(kenv.namespace, {
        "metadata": {"name": name, "labels": labels},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "sandbox", "image": "sim",
                                 "command": ["sh", "-c", script]}]}},
        _preload_content=False)


# -- 1. a workload under our name that is not ours is gone -------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_check_of_a_workload_replaced_by_another_installations_is_not_resumable(
        kenv: KubeEnv, backend: str) -> None:
    # given a lease whose workload was deleted, and another installation's workload running
    # under the same name since
    request = kenv.request(backend=backend, command=LOOP)
    acquired = kenv.provider.acquire(request)
    handle = kenv.handle(request.name, backend, **acquired.meta)
    theirs = ours_then_theirs(kenv, backend, handle)
    assert theirs["metadata"]["uid"] != acquired.meta["uid"]
    # when checking the lease (with the uid acquire recorded, and with none recorded)
    for meta in (acquired.meta, {}):
        result = kenv.provider.resume_check(kenv.handle(request.name, backend, **meta), 5)
        # then it is gone: their workload is not this lease's, and it is left alone
        assert result.outcome is ResumeOutcome.NOT_RESUMABLE, (meta, result)
        assert "is not this lease's" in (result.reason or "")
    assert kenv.read(KIND[backend], request.name)["metadata"]["uid"] == theirs["metadata"]["uid"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_never_sends_a_runs_data_into_another_installations_workload(
        kenv: KubeEnv, backend: str) -> None:
    # given a pool member whose workload was deleted, and another installation's workload
    # running under the same name since
    request, handle = member(kenv, backend)
    ours_then_theirs(kenv, backend, handle)
    kenv.proxy.reset_counts()
    # when a run claims the member
    secret = new_secret()
    claimed = kenv.provider.claim(handle, claim_request(request.lease_id, secret))
    # then it is refused as gone, and nothing was exec'd into their pod
    assert claimed.outcome is ClaimOutcome.NOT_RESUMABLE
    assert "is not this lease's" in (claimed.reason or "")
    assert kenv.proxy.count("GET", r"/exec$") == 0
    assert kenv.proxy.count("POST", r"/exec$") == 0
    assert secret not in (claimed.reason or "")


# -- 2. what another controller owns is not ours, whatever its labels --------------------------

def users_deployment(kenv: KubeEnv, workload: str, backend: str) -> dict[str, Any]:
    """A user's Deployment whose pod template copied the labels of our workload
    ``workload``; returns its pod (made by the ReplicaSet controller)."""
    app = f"web-{secrets.token_hex(3)}"
    copied = {"app": app, "app.kubernetes.io/managed-by": "leasekeeper",
              "leasekeeper.dev/installation": kenv.installation,
              "leasekeeper.dev/workload": workload, "leasekeeper.dev/backend": backend,
              "leasekeeper.dev/lease-id": workload.removeprefix("lk-")}
    client.AppsV1Api(kenv.admin).create_namespaced_deployment(kenv.namespace, {
        "metadata": {"name": app},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": app}},
                 "template": {"metadata": {"labels": copied},
                              "spec": {"containers": [{"name": "web", "image": "sim",
                                                       "command": LOOP}]}}}},
        _preload_content=False)
    found = some_pod(kenv, f"app={app}", pod_phase_in("Running"))
    refs = found["metadata"]["ownerReferences"]
    assert [r["kind"] for r in refs if r.get("controller")] == ["ReplicaSet"]
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_leaves_the_pods_of_a_users_deployment_that_copied_our_labels(
        kenv: KubeEnv, backend: str) -> None:
    # given a lease, and a user's Deployment whose pods carry that lease's labels
    request = kenv.request(backend=backend, command=LOOP)
    acquired = kenv.provider.acquire(request)
    theirs = users_deployment(kenv, request.name, backend)
    their_pod = theirs["metadata"]["name"]
    kenv.proxy.reset_counts()
    # when the lease is destroyed
    kenv.provider.destroy(kenv.handle(request.name, backend, **acquired.meta))
    # then the lease's workload went, and their pod was never deleted
    kenv.wait(KIND[backend], request.name, gone)
    assert kenv.proxy.count("DELETE", rf"/pods/{their_pod}$") == 0
    pod = kenv.read("pod", their_pod)
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")


def test_list_managed_reports_no_orphan_for_a_users_deployment_that_copied_our_labels(
        kenv: KubeEnv) -> None:
    # given no lease, and a user's Deployment whose pods carry the labels of a workload
    # lk-copied of this installation (which does not exist)
    users_deployment(kenv, "lk-copied", "job")
    # when listing what this installation manages; then their pod is no orphan of ours (the
    # orphan sweep would delete it, and the Deployment make it again, forever)
    assert "lk-copied" not in {r.name for r in kenv.provider.list_managed()}


# -- 3. a pod counts only if the workload controls it ------------------------------------------

def sandbox_naming_a_bare_pod(kenv: KubeEnv, name: str) -> str:
    """A bare running pod (made by hand, no controller), which the Ready Sandbox ``name``'s
    status then names; returns the pod's name."""
    bare = f"bare-{secrets.token_hex(3)}"
    bare_pod(kenv, bare, {"app": "hand-made"}, "while :; do sleep 1; done")
    kenv.wait("pod", bare, pod_phase_in("Running"))
    kenv.custom.patch_namespaced_custom_object_status(
        GROUP, "v1alpha1", kenv.namespace, PLURAL, name, {"status": {"podName": bare}},
        _content_type="application/merge-patch+json", _preload_content=False)
    kenv.wait("sandbox", name, lambda sb: (sb or {}).get("status", {}).get("podName") == bare)
    return bare


def test_resume_check_of_a_sandbox_naming_a_pod_not_its_own_is_not_resumable(
        kenv: KubeEnv) -> None:
    # given a Ready Sandbox, its own pod running, whose status names a pod made by hand
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    bare = sandbox_naming_a_bare_pod(kenv, request.name)
    assert kenv.read("pod", request.name) is not None
    # when checking resume (with the pod acquire recorded, and with none)
    for meta in (acquired.meta, {**acquired.meta, "pod_name": None}):
        result = kenv.provider.resume_check(kenv.handle(request.name, **meta), 5)
        # then the inconsistent Sandbox is not resumable, saying which pod and why; neither
        # the bare pod nor the Sandbox's own is named
        assert result.outcome is ResumeOutcome.NOT_RESUMABLE, result
        assert f"Pod {bare}, which Sandbox {request.name} names, is not its" in \
            (result.reason or ""), result
        assert "it has no controller" in (result.reason or ""), result
        assert not result.details.get("pod_name"), result


def test_claim_never_delivers_to_a_sandbox_naming_a_pod_not_its_own(kenv: KubeEnv) -> None:
    # given a Ready pool member Sandbox whose status names a pod made by hand, and whose own
    # pod (the one acquire recorded) still runs
    request, handle = member(kenv, "sandbox-cr")
    assert handle.meta["pod_name"] == request.name
    bare = sandbox_naming_a_bare_pod(kenv, request.name)
    kenv.proxy.reset_counts()
    secret = new_secret()
    # when a run claims it (with the pod acquire recorded, and with none)
    for meta in (handle.meta, {**handle.meta, "pod_name": None}):
        claimed = kenv.provider.claim(kenv.handle(request.name, **meta),
                                      claim_request(request.lease_id, secret))
        # then it is not claimable, and the run's data went into no pod at all
        assert claimed.outcome is ClaimOutcome.NOT_RESUMABLE, claimed
        assert f"Pod {bare}, which Sandbox {request.name} names, is not its" in \
            (claimed.reason or ""), claimed
        assert secret not in (claimed.reason or "")
    assert kenv.proxy.count(None, r"/exec$") == 0


def test_resume_check_never_names_a_bare_pod_labelled_with_the_job_name(kenv: KubeEnv) -> None:
    # given a running Job, and a bare running pod labelled job-name=<the Job> (named so that
    # the API server lists it first: picked on any tie)
    request = kenv.request(backend="job", command=LOOP)
    acquired = kenv.provider.acquire(request)
    some_pod(kenv, f"job-name={request.name}", pod_phase_in("Running"))
    bare = f"a-bare-{secrets.token_hex(3)}"
    bare_pod(kenv, bare, {"job-name": request.name}, "while :; do sleep 1; done")
    kenv.wait("pod", bare, pod_phase_in("Running"))
    # when checking resume; then the pod named is the Job's own
    result = kenv.provider.resume_check(kenv.handle(request.name, "job", **acquired.meta), 5)
    assert result.outcome is ResumeOutcome.RESUMABLE, result
    assert result.details["pod_name"] not in (None, bare)
    assert result.details["pod_name"].startswith(f"{request.name}-")


def test_a_finished_jobs_exit_code_is_never_a_bare_pods(kenv: KubeEnv) -> None:
    # given a Job that exited 3, and a bare pod labelled as its pod (job-name and our labels)
    # that exited 9 after it
    request = kenv.request(backend="job", command=["sh", "-c", "exit 3"])
    acquired = kenv.provider.acquire(request)
    kenv.wait("job", request.name, condition_is("Failed"))
    bare = f"a-bare-{secrets.token_hex(3)}"
    bare_pod(kenv, bare, {"job-name": request.name,
                          "leasekeeper.dev/installation": kenv.installation,
                          "leasekeeper.dev/workload": request.name,
                          "leasekeeper.dev/backend": "job"}, "exit 9")
    kenv.wait("pod", bare, pod_phase_in("Failed"))
    # when reading its exit (job_exit, and the listing sweep.finish_exited reads)
    handle = kenv.handle(request.name, "job", **acquired.meta)
    # then it is the Job's own command's code
    assert kenv.provider.job_exit(handle) == (JobPhase.FAILED, 3)
    listed = {r.name: r for r in kenv.provider.list_managed()}
    assert listed[request.name].exit_code == 3
    assert listed[request.name].meta["pod_name"] != bare


# -- 4. a Secret another controller owns is never adopted, replaced nor deleted ----------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_acquire_never_adopts_replaces_or_deletes_a_secret_another_controller_owns(
        kenv: KubeEnv, backend: str) -> None:
    # given a Secret under the lease's Secret name, labelled as this lease's, which another
    # operator's object controls (a ConfigMap stands in for its custom resource: it exists,
    # so the garbage collector keeps the Secret)
    request = kenv.request(backend=backend, command=LOOP)
    operator = f"operator-{secrets.token_hex(3)}"
    owner = json.loads(kenv.core.create_namespaced_config_map(
        kenv.namespace, {"metadata": {"name": operator}}, _preload_content=False).data)
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme")
    theirs = json.loads(kenv.core.create_namespaced_secret(kenv.namespace, build_secret(
        identity, request.spec, kenv.provider.defaults, Backend(backend), "their-token",
        OwnerRef("v1", "ConfigMap", operator, owner["metadata"]["uid"])),
        _preload_content=False).data)
    kenv.proxy.reset_counts()
    # when the lease is acquired
    with pytest.raises(ProviderConflict) as info:
        kenv.provider.acquire(request)
    # then it is refused, naming the Secret, its controller and what to do
    text = str(info.value)
    assert f"Secret {kenv.namespace}/{request.name}-env" in text, text
    assert f"controlled by ConfigMap {operator}" in text, text
    assert "refusing to adopt, replace or delete it" in text, text
    assert "LEASEKEEPER_KUBE_NAMESPACE" in text, text
    # and the failed acquire's cleanup removed its own workload, never their Secret
    kenv.wait(KIND[backend], request.name, gone)
    assert kenv.proxy.count("DELETE", r"/secrets/") == 0
    assert kenv.proxy.count("PUT", r"/secrets/") == kenv.proxy.count("PATCH", r"/secrets/") == 0
    found = kenv.read("secret", f"{request.name}-env")
    assert found is not None and found["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert not found["metadata"].get("deletionTimestamp")


# -- 5. a Sandbox made under the lease's name during a wait is not the lease's -----------------

def sandbox_replaced_while_held(kenv: KubeEnv, controller: Any, name: str, rule: Rule, *,
                                ready: bool) -> dict[str, Any]:
    """Once a request is held by ``rule``: the lease's Sandbox is deleted (and gone), another
    installation makes its own under the name (Ready if ``ready``, else never Ready), then
    the request is released. Returns their Sandbox."""
    try:
        assert rule.arrived.wait(60), "the held request never came"
        kenv.custom.delete_namespaced_custom_object(GROUP, "v1alpha1", kenv.namespace, PLURAL,
                                                    name, _preload_content=False)
        kenv.wait("sandbox", name, gone)
        if ready:  # their pod reads their Secret (ours goes with our Sandbox)
            kenv.wait("secret", f"{name}-env", gone)
            kenv.core.create_namespaced_secret(kenv.namespace, {
                "metadata": {"name": f"{name}-env", "labels": {"app": "someone-else"}},
                "stringData": {"THEIRS": "their-value"}}, _preload_content=False)
            controller.reset(kenv.namespace, name)
        identity = LeaseIdentity("their-lease", name, "someone-else", "acme")
        theirs = kenv.create_sandbox(build_sandbox(
            identity, SandboxSpec(tenant="acme", command=LOOP), kenv.provider.defaults,
            datetime.now(UTC)))
        if ready:
            kenv.wait("sandbox", name, condition_is("Ready"))
        return theirs
    finally:
        rule.released.set()


def expired_watch_held(kenv: KubeEnv) -> Rule:
    """The next Sandbox watch is held, then answered 410 Expired: the wait reads the
    Sandbox again, and sees no DELETED event."""
    return kenv.proxy.hold_then_fail("GET", r"/sandboxes$", 410, reason="Expired",
                                     query="watch=true", message="too old resource version")


def test_acquire_never_takes_a_sandbox_made_under_its_name_while_it_waited(
        kenv: KubeEnv, steered_controller: Any) -> None:
    # given an acquire waiting for its Sandbox to be Ready, whose watch is answered 410 only
    # after that Sandbox was deleted and another installation's, Ready, made under its name
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    rule = expired_watch_held(kenv)
    with ThreadPoolExecutor(1) as pool:
        acquiring = pool.submit(kenv.provider.acquire, request)
        theirs = sandbox_replaced_while_held(kenv, steered_controller, request.name, rule,
                                             ready=True)
        # then the acquire fails (transient: a retry finds their Sandbox and refuses it)
        with pytest.raises(TransientProviderError) as info:
            acquiring.result()
    text = str(info.value)
    assert f"Sandbox {request.name} was deleted while waiting" in text, text
    assert "another Sandbox now holds its name" in text, text
    # and their Sandbox was left alone
    found = kenv.read("sandbox", request.name)
    assert found is not None and found["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert not found["metadata"].get("deletionTimestamp")


@pytest.mark.parametrize("theirs_ready", [False, True], ids=["theirs-pending", "theirs-ready"])
def test_resume_check_never_waits_on_a_sandbox_made_under_its_name_meanwhile(
        kenv: KubeEnv, steered_controller: Any, theirs_ready: bool) -> None:
    # given the lease's Sandbox, not Ready yet, checked while its watch is answered 410 only
    # after it was deleted and another installation's made under its name
    request = kenv.request()
    steered_controller.never_ready(kenv.namespace, request.name)
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme")
    ours = kenv.create_sandbox(build_sandbox(identity, request.spec, kenv.provider.defaults,
                                             datetime.now(UTC)))
    handle = kenv.handle(request.name, uid=ours["metadata"]["uid"])
    rule = expired_watch_held(kenv)
    with ThreadPoolExecutor(1) as pool:
        checking = pool.submit(kenv.provider.resume_check, handle, 30)
        sandbox_replaced_while_held(kenv, steered_controller, request.name, rule,
                                    ready=theirs_ready)
        result = checking.result()
    # then the lease's Sandbox is gone at once (no wait on theirs until the timeout)
    assert result.outcome is ResumeOutcome.NOT_RESUMABLE, result
    assert "is not this lease's" in (result.reason or ""), result
