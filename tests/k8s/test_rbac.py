"""Owns the tests of deploy/'s RBAC: the ServiceAccount, Role and RoleBinding applied exactly as
written (only the namespace rewritten, as ``kustomize edit set namespace`` would) to an
RBAC-mode API server, and the provider run with a token of that ServiceAccount: the Role is
enough for both backends and for warm pools (a member's acquire, its claim by exec), and each
of its rules is needed (without it, the operation that uses it fails at once with an error
naming the verb and resource to grant). ``pods/exec`` is granted with two verbs because a
WebSocket exec is authorized as ``get`` before Kubernetes 1.31 and as ``create`` from then on:
on this server, the one it does not check is shown not to be needed."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from providers.base import (
    AcquireOutcome,
    AcquireRequest,
    ClaimOutcome,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
    ResumeOutcome,
)
from providers.errors import ProviderError, is_transient
from providers.kubernetes.provider import KubernetesProvider, build_kubernetes_provider
from providers.spec import SandboxSpec
from tests.cluster.cluster import ClusterAccess, KubeCluster
from tests.cluster.kubeconfig import api_client_from_kubeconfig
from tests.cluster.waits import condition_is, gone
from tests.k8s.conftest import KubeEnv, provider_settings

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ACCOUNT = "leasekeeper-worker"
LOOP = ["sh", "-c", "while :; do sleep 1; done"]
Obj = dict[str, Any]


def deploy_manifests() -> list[Obj]:
    """The documents deploy/kustomization.yaml lists, in its order."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def role_rules() -> list[tuple[str, str, str]]:
    """(group, resource, verb) for every verb the Role grants."""
    (role,) = [d for d in deploy_manifests() if d["kind"] == "Role"]
    return [(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]]


def apply_deploy(api: client.ApiClient, namespace: str,
                 without: Collection[tuple[str, str]] = ()) -> None:
    """Create deploy/'s objects in ``namespace``, optionally with some (resource, verb) pairs
    left out of the Role."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    for doc in map(copy.deepcopy, deploy_manifests()):
        original = doc["metadata"].get("namespace")
        doc["metadata"]["namespace"] = namespace
        match doc["kind"]:
            case "ServiceAccount":
                core.create_namespaced_service_account(namespace, doc, _preload_content=False)
            case "Role":
                for resource, verb in without:
                    for rule in doc["rules"]:
                        if resource in rule["resources"]:
                            rule["verbs"] = [v for v in rule["verbs"] if v != verb]
                doc["rules"] = [rule for rule in doc["rules"] if rule["verbs"]]
                rbac.create_namespaced_role(namespace, doc, _preload_content=False)
            case "RoleBinding":
                for subject in doc["subjects"]:
                    if subject.get("namespace") == original:
                        subject["namespace"] = namespace
                rbac.create_namespaced_role_binding(namespace, doc, _preload_content=False)
            case other:
                raise AssertionError(f"deploy/ has a {other}; teach this test to apply it")


def allowed(api: client.ApiClient, namespace: str, group: str, resource: str,
            verb: str) -> bool:
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"namespace": namespace, "group": group,
                                         "resource": resource, "verb": verb}}})
    return bool(review.status.allowed)


@dataclass
class Worker:
    """The provider with the ServiceAccount's token (through the fault proxy), plus a plain
    client with that token for access reviews."""

    provider: KubernetesProvider
    api: client.ApiClient

    def wait_until(self, namespace: str, expected: dict[tuple[str, str, str], bool],
                   timeout_s: float = 30.0) -> None:
        """Until the authorizer's cache agrees with the Role just written."""
        deadline = time.monotonic() + timeout_s
        while any(allowed(self.api, namespace, *rule) != want
                  for rule, want in expected.items()):
            if time.monotonic() > deadline:
                raise AssertionError(f"RBAC did not converge to {expected} in {timeout_s}s")
            time.sleep(0.05)


@pytest.fixture
def worker_factory(kube_cluster: ClusterAccess, kenv: KubeEnv
                   ) -> Iterator[Callable[..., Worker]]:
    if isinstance(kube_cluster, KubeCluster):
        assert kube_cluster.authorization_mode == "RBAC", (
            "these tests need an RBAC-mode API server: unset LEASEKEEPER_TEST_AUTHZ")
    made: list[Worker] = []

    def make(*without: tuple[str, str]) -> Worker:
        apply_deploy(kenv.admin, kenv.namespace, without)
        token = kube_cluster.service_account_token(kenv.namespace, ACCOUNT, create=False)
        provider = build_kubernetes_provider(provider_settings(
            kenv.proxy.kubeconfig_for_token(token), kenv.namespace, kenv.installation))
        worker = Worker(provider, api_client_from_kubeconfig(
            kube_cluster.kubeconfig_for_token(token, namespace=kenv.namespace)))
        made.append(worker)
        expected = {rule: (rule[1], rule[2]) not in without for rule in role_rules()}
        worker.wait_until(kenv.namespace, expected)
        return worker

    yield make
    for worker in made:
        worker.provider.api.api_client.close()
        worker.api.close()


def handle(kenv: KubeEnv, request: AcquireRequest, meta: dict[str, Any] | None = None,
           ) -> LeaseHandle:
    return kenv.handle(request.name, request.spec.backend or "sandbox-cr", **(meta or {}))


def test_the_deploy_role_is_enough_for_both_backends(
        worker_factory: Callable[..., Worker], kenv: KubeEnv) -> None:
    # given deploy/ applied as written, and the provider holding only that ServiceAccount
    worker = worker_factory()
    provider = worker.provider
    # (which really is a restricted identity)
    assert not allowed(worker.api, kenv.namespace, "", "secrets", "update")
    assert not allowed(worker.api, "default", "", "pods", "list")
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(worker.api).list_namespace()
    assert denied.value.status == 403
    for backend in ("sandbox-cr", "job"):
        request = kenv.request(backend=backend, command=LOOP)
        # acquire, and acquire again (409 on both objects: read, found ours, adopted)
        acquired = provider.acquire(request)
        assert acquired.outcome is AcquireOutcome.CREATED
        assert provider.acquire(request).outcome is AcquireOutcome.ADOPTED
        lease = handle(kenv, request, acquired.meta)
        if backend == "job":
            kenv.wait("job", request.name,
                      lambda j: (j or {}).get("status", {}).get("active") == 1)
        assert provider.resume_check(lease, 10).outcome is ResumeOutcome.RESUMABLE
        listed = {r.name: r for r in provider.list_managed()}
        assert listed[request.name].lease_id == request.lease_id
        assert provider.destroy(lease) is DestroyOutcome.DESTROYED
        kenv.wait("sandbox" if backend == "sandbox-cr" else "job", request.name, gone)
        assert provider.resume_check(lease, 5).outcome is ResumeOutcome.NOT_RESUMABLE
        assert provider.destroy(lease) is DestroyOutcome.ALREADY_GONE
    # and a finished Job's exit code is readable with these rights too
    done = kenv.request(backend="job", command=["sh", "-c", "exit 3"])
    provider.acquire(done)
    kenv.wait("job", done.name, condition_is("Failed"))
    assert {r.name: r for r in provider.list_managed()}[done.name].exit_code == 3
    # and warm pools: a member of each backend acquired (a Job's pod watched until it runs),
    # then claimed (its run's data delivered by exec)
    for backend in ("sandbox-cr", "job"):
        pooled = _pool_member(backend)(kenv)
        acquired = provider.acquire(pooled)
        assert acquired.meta["pod_name"]
        claimed = provider.claim(handle(kenv, pooled, acquired.meta), _claim_request(pooled))
        assert claimed.outcome is ClaimOutcome.CLAIMED, claimed.reason
        assert provider.destroy(handle(kenv, pooled, acquired.meta)) is DestroyOutcome.DESTROYED


# (resource, verb) → what the provider does that needs it: an optional setup done with
# admin rights (returns the request), and the operation run with the ServiceAccount.
Setup = Callable[[KubeEnv], AcquireRequest]
Operation = Callable[[KubernetesProvider, KubeEnv, AcquireRequest], object]


def _sandbox(kenv: KubeEnv) -> AcquireRequest:
    return kenv.request()


def _job(kenv: KubeEnv) -> AcquireRequest:
    return kenv.request(backend="job", command=LOOP)


def _acquired(make: Setup) -> Setup:
    def setup(kenv: KubeEnv) -> AcquireRequest:
        request = make(kenv)
        kenv.provider.acquire(request)
        return request
    return setup


def _acquire(p: KubernetesProvider, kenv: KubeEnv, r: AcquireRequest) -> object:
    return p.acquire(r)


def _resume(p: KubernetesProvider, kenv: KubeEnv, r: AcquireRequest) -> object:
    return p.resume_check(handle(kenv, r), 5)


def _destroy(p: KubernetesProvider, kenv: KubeEnv, r: AcquireRequest) -> object:
    return p.destroy(handle(kenv, r))


def _list(p: KubernetesProvider, kenv: KubeEnv, r: AcquireRequest) -> object:
    return p.list_managed()


def _pool_member(backend: str) -> Setup:
    def setup(kenv: KubeEnv) -> AcquireRequest:
        lease_id = kenv.new_lease()
        return AcquireRequest(
            lease_id=lease_id, name=kenv.provider.lease_name(lease_id),
            spec=SandboxSpec(tenant="acme", backend=backend, command=LOOP), labels={},
            timeout_s=30, pool="rbac-pool")
    return setup


def _claim_request(r: AcquireRequest) -> ClaimRequest:
    return ClaimRequest(lease_id=r.lease_id, run_id=f"run-{r.lease_id}", tenant="acme",
                        labels={}, env={"A": "1"}, secret_env={"KEY": "rbac-secret"})


def _claim(p: KubernetesProvider, kenv: KubeEnv, r: AcquireRequest) -> object:
    claimed = p.claim(handle(kenv, r), _claim_request(r))
    assert claimed.outcome is ClaimOutcome.CLAIMED, claimed.reason
    return claimed


def exec_verb(api: client.ApiClient) -> str:
    """The verb on pods/exec this API server checks for a WebSocket exec (an HTTP GET):
    ``get`` before 1.31, ``create`` from 1.31 on."""
    version = client.VersionApi(api).get_code()
    minor = int("".join(ch for ch in version.minor if ch.isdigit()))
    return "create" if (int(version.major), minor) >= (1, 31) else "get"


NEEDS: dict[tuple[str, str], tuple[Setup, Operation]] = {
    ("sandboxes", "create"): (_sandbox, _acquire),
    ("sandboxes", "get"): (_acquired(_sandbox), _resume),
    ("sandboxes", "watch"): (_sandbox, _acquire),
    ("sandboxes", "list"): (_sandbox, _list),
    ("sandboxes", "delete"): (_acquired(_sandbox), _destroy),
    ("jobs", "create"): (_job, _acquire),
    ("jobs", "get"): (_acquired(_job), _resume),
    ("jobs", "list"): (_job, _list),
    ("jobs", "delete"): (_acquired(_job), _destroy),
    ("pods", "get"): (_acquired(_sandbox), _resume),
    ("pods", "list"): (_acquired(_job), _resume),
    ("pods", "watch"): (_pool_member("job"), _acquire),
    ("pods", "delete"): (_acquired(_sandbox), _destroy),
    ("pods/exec", "get"): (_acquired(_pool_member("sandbox-cr")), _claim),
    ("pods/exec", "create"): (_acquired(_pool_member("sandbox-cr")), _claim),
    ("secrets", "create"): (_sandbox, _acquire),
    ("secrets", "get"): (_acquired(_sandbox), _acquire),  # the 409 on the Secret: ours?
    ("secrets", "list"): (_sandbox, _list),
    ("secrets", "delete"): (_acquired(_sandbox), _destroy),
}


# A pool member Job's acquire lists its pods, and watches them only while none runs yet: with
# the controller manager stopped, its pod cannot run before the list, so the watch happens.
NEEDS_STOPPED_CONTROLLERS = {("pods", "watch")}


# Rules the provider uses when it has them and does without otherwise (said once): a Job's
# acquire reads the Job controller's Events on it (tests/k8s/test_provider_job_pod_refused.py)
OPTIONAL = {("events", "list"), ("events", "watch")}


def test_every_rule_of_the_role_is_used_by_an_operation() -> None:
    assert sorted((resource, verb) for _, resource, verb in role_rules()) == sorted(
        [*NEEDS, *OPTIONAL])


def test_the_deploy_role_without_events_still_acquires_a_job(
        worker_factory: Callable[..., Worker], kenv: KubeEnv) -> None:
    # given the Role without its optional rules
    worker = worker_factory(*sorted(OPTIONAL))
    # when a Job is acquired; then it is, as before the provider read Events
    request = _job(kenv)
    assert worker.provider.acquire(request).outcome is AcquireOutcome.CREATED


@pytest.mark.parametrize(("resource", "verb"), sorted(NEEDS))
def test_a_missing_permission_fails_at_once_naming_what_to_grant(
        worker_factory: Callable[..., Worker], kenv: KubeEnv, resource: str, verb: str,
        request: pytest.FixtureRequest) -> None:
    # given the Role without this one verb
    worker = worker_factory((resource, verb))
    setup, operation = NEEDS[(resource, verb)]
    acquire_request = setup(kenv)
    if resource == "pods/exec" and verb != exec_verb(kenv.admin):
        # the verb this server does not check for a WebSocket exec (the other does): the
        # claim works without it; it is in the Role for servers on the other side of 1.31
        operation(worker.provider, kenv, acquire_request)
        return
    during: AbstractContextManager[object] = contextlib.nullcontext()
    if (resource, verb) in NEEDS_STOPPED_CONTROLLERS:
        during = request.getfixturevalue("frozen_controllers")()
    # when the provider does what needs it; then it fails, terminal, saying what to grant
    with during, pytest.raises(ProviderError) as info:
        operation(worker.provider, kenv, acquire_request)
    text = str(info.value)
    assert not is_transient(info.value), text
    assert "HTTP 403" in text, text
    assert f'lacks the RBAC permission to "{verb}" "{resource}"' in text, text
    assert f'add verb "{verb}" on resource "{resource}"' in text, text
    assert "deploy/rbac/role.yaml" in text, text


def test_a_worker_without_pods_exec_cannot_claim_and_is_told_what_to_grant(
        worker_factory: Callable[..., Worker], kenv: KubeEnv) -> None:
    # given the Role without any pods/exec rule, and a warm member made with admin rights
    worker = worker_factory(("pods/exec", "get"), ("pods/exec", "create"))
    request = _acquired(_pool_member("sandbox-cr"))(kenv)
    claim = _claim_request(request)
    # when the worker claims it; then the API server's 403 comes back terminal, naming the
    # verb it refused on pods/exec, and no secret
    with pytest.raises(ProviderError) as info:
        worker.provider.claim(handle(kenv, request), claim)
    text = str(info.value)
    verb = exec_verb(kenv.admin)
    assert not is_transient(info.value) and info.value.status == 403, text
    assert text.startswith(f"kubernetes: exec into Pod {kenv.namespace}/{request.name} "
                           "(container sandbox) failed (HTTP 403 Forbidden"), text
    assert f'lacks the RBAC permission to "{verb}" "pods/exec"' in text, text
    assert f'add verb "{verb}" on resource "pods/exec"' in text, text
    assert "rbac-secret" not in text
