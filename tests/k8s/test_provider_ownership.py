"""Owns the integration tests of the test that makes an object this lease's, against the real
API server and its controllers, with the foreign objects made directly by the admin client:
- ``destroy`` with nothing recorded (a worker killed before it recorded the uids) touches no
  part (workload, Secret, pod) that acquire would refuse to adopt: one labelled with this
  installation and the lease's workload name, but another lease's id, gets no DELETE at all;
- a create answered 409 whose follow-up read finds nothing (the garbage collector finished
  the Foreground delete of an earlier attempt's workload in between) creates again;
- a workload labelled as this lease's that another controller owns is refused, naming it.
"""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from providers.base import AcquireOutcome, DestroyOutcome
from providers.errors import ProviderConflict
from providers.kubernetes.manifests import (
    Backend,
    LeaseIdentity,
    OwnerRef,
    build_job,
    build_sandbox,
    build_secret,
)
from providers.spec import SandboxSpec
from tests.cluster.waits import gone, pod_phase_in
from tests.k8s.conftest import KubeEnv
from tests.k8s.test_provider_foreign import BACKENDS, KIND, LOOP, some_pod

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

OTHER_LEASE = "someotherlease"
PLURALS = {"sandbox-cr": "sandboxes", "job": "jobs"}


def workload_manifest(kenv: KubeEnv, backend: str, identity: LeaseIdentity,
                      spec: SandboxSpec) -> dict[str, Any]:
    if backend == "job":
        return build_job(identity, spec, kenv.provider.defaults)
    return build_sandbox(identity, spec, kenv.provider.defaults, datetime.now(UTC))


def create_workload(kenv: KubeEnv, backend: str, manifest: dict[str, Any]) -> dict[str, Any]:
    if backend == "job":
        created: dict[str, Any] = json.loads(kenv.batch.create_namespaced_job(
            kenv.namespace, manifest, _preload_content=False).data)
        return created
    return kenv.create_sandbox(manifest)


def parts_labelled_for_another_lease(kenv: KubeEnv, backend: str, name: str) -> list[str]:
    """Under the lease's names: a Secret, a workload and (made by its controller) its pod,
    each labelled with this installation and workload ``name`` but lease OTHER_LEASE (label
    and annotation), none controlled by anything of ours. Returns the uids."""
    identity = LeaseIdentity(OTHER_LEASE, name, kenv.installation, "acme")
    spec = SandboxSpec(tenant="acme", command=LOOP)
    secret = build_secret(identity, spec, kenv.provider.defaults, Backend(backend), "theirs",
                          OwnerRef("v1", "ConfigMap", "unused", "unused"))
    del secret["metadata"]["ownerReferences"]  # made by hand: nothing controls it
    made = json.loads(kenv.core.create_namespaced_secret(
        kenv.namespace, secret, _preload_content=False).data)
    workload = create_workload(kenv, backend, workload_manifest(kenv, backend, identity, spec))
    pod = some_pod(kenv, f"leasekeeper.dev/workload={name}", pod_phase_in("Running"))
    assert pod["metadata"]["labels"]["leasekeeper.dev/lease-id"] == OTHER_LEASE
    return [made["metadata"]["uid"], workload["metadata"]["uid"], pod["metadata"]["uid"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_by_name_never_deletes_parts_labelled_for_another_lease(
        kenv: KubeEnv, backend: str) -> None:
    # given a workload, its pod and a Secret under the lease's names, labelled with this
    # installation and the lease's workload name, but another lease's id
    request = kenv.request(backend=backend, command=LOOP)
    name = request.name
    uids = parts_labelled_for_another_lease(kenv, backend, name)
    # which acquire refuses to adopt
    with pytest.raises(ProviderConflict, match="refusing to adopt"):
        kenv.provider.acquire(request)
    kenv.proxy.reset_counts()
    # when the lease is destroyed with nothing recorded (a worker killed before it recorded
    # the uids)
    outcome = kenv.provider.destroy(kenv.handle(name, backend))
    # then no DELETE was even sent, for any part, and every part is still there
    assert outcome is DestroyOutcome.ALREADY_GONE
    assert kenv.proxy.count("DELETE") == 0, kenv.proxy.records
    pod = some_pod(kenv, f"leasekeeper.dev/workload={name}", lambda p: p is not None)
    found = [kenv.read("secret", f"{name}-env"), kenv.read(KIND[backend], name), pod]
    assert [(f or {}).get("metadata", {}).get("uid") for f in found] == uids
    assert not any(f["metadata"].get("deletionTimestamp") for f in found if f)


@pytest.mark.parametrize("backend", BACKENDS)
def test_acquire_creates_again_when_the_workload_a_409_named_is_gone_when_read(
        kenv: KubeEnv, backend: str) -> None:
    # given the lease's workload from an earlier attempt
    request = kenv.request(backend=backend, command=LOOP)
    first = kenv.provider.acquire(request)
    # when the lease is acquired again, and that workload is deleted (and gone) between the
    # create's 409 and the read that follows it
    rule = kenv.proxy.hold("GET", rf"/{PLURALS[backend]}/{request.name}$")
    kenv.proxy.reset_counts()
    with ThreadPoolExecutor(1) as pool:
        acquiring = pool.submit(kenv.provider.acquire, request)
        try:
            assert rule.arrived.wait(60), "the read after the 409 never came"
            delete_workload(kenv, backend, request.name)
            kenv.wait(KIND[backend], request.name, gone)
        finally:
            rule.released.set()
        acquired = acquiring.result()
    # then it made a new one
    assert kenv.proxy.count("POST", rf"/{PLURALS[backend]}$") == 2
    assert acquired.outcome is AcquireOutcome.CREATED, acquired
    assert acquired.meta["uid"] != first.meta["uid"]
    found = kenv.read(KIND[backend], request.name)
    assert found is not None and found["metadata"]["uid"] == acquired.meta["uid"]


def delete_workload(kenv: KubeEnv, backend: str, name: str) -> None:
    body = client.V1DeleteOptions(propagation_policy="Foreground")
    if backend == "job":
        kenv.batch.delete_namespaced_job(name, kenv.namespace, body=body)
    else:
        kenv.custom.delete_namespaced_custom_object(
            "agents.x-k8s.io", "v1alpha1", kenv.namespace, "sandboxes", name, body=body)


@pytest.mark.parametrize("backend", BACKENDS)
def test_acquire_refusing_a_workload_another_controller_owns_names_that_controller(
        kenv: KubeEnv, backend: str) -> None:
    # given a workload under the lease's name, with this installation's and this lease's
    # labels, that another operator's object controls (a ConfigMap stands in for it)
    request = kenv.request(backend=backend, command=LOOP)
    operator = f"operator-{secrets.token_hex(3)}"
    owner = json.loads(kenv.core.create_namespaced_config_map(
        kenv.namespace, {"metadata": {"name": operator}}, _preload_content=False).data)
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme")
    manifest = workload_manifest(kenv, backend, identity, request.spec)
    manifest["metadata"]["ownerReferences"] = [
        OwnerRef("v1", "ConfigMap", operator, owner["metadata"]["uid"]).manifest()]
    theirs = create_workload(kenv, backend, manifest)
    kenv.proxy.reset_counts()
    # when the lease is acquired
    with pytest.raises(ProviderConflict) as info:
        kenv.provider.acquire(request)
    # then it is refused, naming the workload, its controller and what to do
    text = str(info.value)
    assert f"{backend} {kenv.namespace}/{request.name} already exists" in text, text
    assert f"it is controlled by ConfigMap {operator}" in text, text
    assert f"not lease {request.lease_id}'s" in text, text
    assert "refusing to adopt it" in text, text
    # and it was left alone
    assert kenv.proxy.count("DELETE") == 0
    found = kenv.read(KIND[backend], request.name)
    assert found is not None and found["metadata"]["uid"] == theirs["metadata"]["uid"]
