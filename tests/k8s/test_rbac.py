"""Owns the tests of deploy/'s RBAC: the ServiceAccount, Role and RoleBinding applied exactly as
written (only the namespace rewritten, as ``kustomize edit set namespace`` would) to an
RBAC-mode API server, and the provider run with a token of that ServiceAccount: the Role is
enough for both backends, and each of its rules is needed (without it, the operation that
uses it fails at once with an error naming the verb and resource to grant)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from providers.base import (
    AcquireOutcome,
    AcquireRequest,
    DestroyOutcome,
    LeaseHandle,
    ResumeOutcome,
)
from providers.errors import ProviderError, is_transient
from providers.kubernetes.provider import KubernetesProvider, build_kubernetes_provider
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
                 without: tuple[str, str] | None = None) -> None:
    """Create deploy/'s objects in ``namespace``, optionally with one (resource, verb) left
    out of the Role."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    for doc in map(copy.deepcopy, deploy_manifests()):
        original = doc["metadata"].get("namespace")
        doc["metadata"]["namespace"] = namespace
        match doc["kind"]:
            case "ServiceAccount":
                core.create_namespaced_service_account(namespace, doc, _preload_content=False)
            case "Role":
                if without is not None:
                    resource, verb = without
                    for rule in doc["rules"]:
                        if resource in rule["resources"]:
                            rule["verbs"] = [v for v in rule["verbs"] if v != verb]
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
                   ) -> Iterator[Callable[[tuple[str, str] | None], Worker]]:
    if isinstance(kube_cluster, KubeCluster):
        assert kube_cluster.authorization_mode == "RBAC", (
            "these tests need an RBAC-mode API server: unset LEASEKEEPER_TEST_AUTHZ")
    made: list[Worker] = []

    def make(without: tuple[str, str] | None = None) -> Worker:
        apply_deploy(kenv.admin, kenv.namespace, without)
        token = kube_cluster.service_account_token(kenv.namespace, ACCOUNT, create=False)
        provider = build_kubernetes_provider(provider_settings(
            kenv.proxy.kubeconfig_for_token(token), kenv.namespace, kenv.installation))
        worker = Worker(provider, api_client_from_kubeconfig(
            kube_cluster.kubeconfig_for_token(token, namespace=kenv.namespace)))
        made.append(worker)
        expected = {rule: (rule[1], rule[2]) != without for rule in role_rules()}
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
    ("pods", "delete"): (_acquired(_sandbox), _destroy),
    ("secrets", "create"): (_sandbox, _acquire),
    ("secrets", "get"): (_acquired(_sandbox), _acquire),  # the 409 on the Secret: ours?
    ("secrets", "list"): (_sandbox, _list),
    ("secrets", "delete"): (_acquired(_sandbox), _destroy),
}


def test_every_rule_of_the_role_is_used_by_an_operation() -> None:
    assert sorted((resource, verb) for _, resource, verb in role_rules()) == sorted(NEEDS)


@pytest.mark.parametrize(("resource", "verb"), sorted(NEEDS))
def test_a_missing_permission_fails_at_once_naming_what_to_grant(
        worker_factory: Callable[..., Worker], kenv: KubeEnv, resource: str,
        verb: str) -> None:
    # given the Role without this one verb
    worker = worker_factory((resource, verb))
    setup, operation = NEEDS[(resource, verb)]
    request = setup(kenv)
    # when the provider does what needs it; then it fails, terminal, saying what to grant
    with pytest.raises(ProviderError) as info:
        operation(worker.provider, kenv, request)
    text = str(info.value)
    assert not is_transient(info.value), text
    assert "HTTP 403" in text, text
    assert f'lacks the RBAC permission to "{verb}" "{resource}"' in text, text
    assert f'add verb "{verb}" on resource "{resource}"' in text, text
    assert "deploy/rbac/role.yaml" in text, text
