"""Owns the tests of "anyone else's object, never" and of pods outliving a stuck garbage
collector, through the Celery tasks on a real worker (``kube_stack``) and the real API server:
- an acquire refused because someone else holds the lease's Secret name (or its workload
  name) fails clearly, and every cleanup after it leaves their objects alone;
- destroying a Job lease deletes its pods itself, so a stuck GC (the controller manager
  frozen) cannot keep them running;
- a workload stuck terminating is reported by ``sweep.orphans`` and its pods are deleted;
- a Secret labelled with this installation and a lease's workload name but another lease's
  id (made by hand) is never deleted by the destroy of the orphan ``sweep.orphans`` records.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from models.schema import LeaseState, RunStatus
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
from tasks import producer
from tests.cluster.waits import gone, pod_phase_in
from tests.k8s.conftest import KubeStack
from tests.k8s.test_tasks import LOOP, acquire, eventually, rid
from workers.app import app

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
THEIR_VALUE = "their-value"


def their_secret(ks: KubeStack, name: str) -> str:
    """Someone else's Secret ``name`` (no leasekeeper labels); returns its uid."""
    created = ks.env.core.create_namespaced_secret(ks.namespace, {
        "metadata": {"name": name, "labels": {"app": "someone-else"}},
        "stringData": {"THEIRS": THEIR_VALUE}})
    return str(created.metadata.uid)


def their_workload(ks: KubeStack, backend: str, name: str) -> str:
    """Another installation's workload under ``name`` (its own labels); returns its uid."""
    identity = LeaseIdentity("their-lease", name, "someone-else", "acme")
    defaults = ks.env.provider.defaults
    if backend == "job":
        job = ks.env.batch.create_namespaced_job(
            ks.namespace, build_job(identity, SandboxSpec(tenant="acme", command=LOOP),
                                    defaults))
        return str(job.metadata.uid)
    sandbox = ks.env.create_sandbox(build_sandbox(identity, SandboxSpec(tenant="acme"),
                                                  defaults, datetime.now(UTC)))
    return str(sandbox["metadata"]["uid"])


def uid(obj: dict[str, Any] | None) -> str | None:
    return None if obj is None else str(obj["metadata"]["uid"])


def job_pod(ks: KubeStack, name: str) -> str:
    """The name of the Job's pod, once it runs."""
    def running() -> str | None:
        pods = ks.env.core.list_namespaced_pod(ks.namespace,
                                               label_selector=f"job-name={name}").items
        return next((p.metadata.name for p in pods if p.status.phase == "Running"), None)
    return eventually(running, f"Job {name}'s pod to run")


# -- a refused acquire: their objects survive every cleanup -----------------------------------

@pytest.mark.parametrize("backend", ["sandbox-cr", "job"])
def test_a_refused_acquire_leaves_someone_elses_secret(kube_stack: KubeStack,
                                                       backend: str) -> None:
    # given an acquire whose workload exists and whose Secret create is in flight
    ks = kube_stack
    run_id = rid()
    held = ks.proxy.hold("POST", r"/secrets$")
    pending = producer.acquire_lease(run_id, {"backend": backend, "command": LOOP})
    eventually(held.arrived.is_set, "the Secret create")
    (lease,) = ks.store.leases()
    name = lease.provider_lease_id
    # when someone else creates a Secret under the lease's Secret name meanwhile
    theirs = their_secret(ks, f"{name}-env")
    held.released.set()
    # then the acquire fails, saying why and what to do
    with pytest.raises(ProviderConflict) as info:
        pending.get(60)
    text = str(info.value)
    assert (f"Secret {ks.namespace}/{name}-env exists and is not lease {lease.lease_id}'s; "
            "refusing to adopt it") in text, text
    # and both cleanups (the provider's, then the task's) leave their Secret alone
    lease = ks.lease(lease.lease_id)
    assert (lease.state, lease.end_reason) == (LeaseState.DESTROYED, "acquire_failed")
    assert ks.run(run_id).status == RunStatus.FAILED
    assert ks.proxy.count("DELETE", rf"/secrets/{name}-env$") == 0
    secret = ks.env.read("secret", f"{name}-env")
    assert uid(secret) == theirs and secret is not None and set(secret["data"]) == {"THEIRS"}
    # while our own workload is gone
    ks.env.wait("sandbox" if backend == "sandbox-cr" else "job", name, gone)


@pytest.mark.parametrize("backend", ["sandbox-cr", "job"])
def test_a_refused_acquire_leaves_someone_elses_workload_and_secret(kube_stack: KubeStack,
                                                                   backend: str) -> None:
    # given an acquire whose workload create is in flight
    ks = kube_stack
    run_id = rid()
    kind = "sandboxes" if backend == "sandbox-cr" else "jobs"
    held = ks.proxy.hold("POST", rf"/{kind}$")
    pending = producer.acquire_lease(run_id, {"backend": backend, "command": LOOP})
    eventually(held.arrived.is_set, "the workload create")
    (lease,) = ks.store.leases()
    name = lease.provider_lease_id
    # when another installation creates a workload and a Secret under the lease's names
    their_kind = "sandbox" if backend == "sandbox-cr" else "job"
    theirs = their_workload(ks, backend, name), their_secret(ks, f"{name}-env")
    held.released.set()
    # then the acquire is refused, and nothing of theirs is deleted (nothing at all)
    with pytest.raises(ProviderConflict) as info:
        pending.get(60)
    assert f"{backend} {ks.namespace}/{name} already exists and is not lease " in str(info.value)
    assert ks.lease(lease.lease_id).state == LeaseState.DESTROYED
    assert ks.run(run_id).status == RunStatus.FAILED
    assert ks.proxy.count("DELETE") == 0
    assert (uid(ks.env.read(their_kind, name)), uid(ks.env.read("secret", f"{name}-env"))
            ) == theirs


# -- a stuck garbage collector ----------------------------------------------------------------

def test_destroying_a_job_lease_deletes_its_pods_while_the_gc_is_stuck(
        kube_stack: KubeStack, frozen_controllers: Any) -> None:
    # given a Job lease whose pod runs
    ks = kube_stack
    acquired = acquire(ks, backend="job", command=LOOP)
    lease_id, name = acquired["lease_id"], acquired["provider_lease_id"]
    pod = job_pod(ks, name)
    with frozen_controllers():
        # when the lease is destroyed while the garbage collector is stuck
        assert producer.destroy_lease(lease_id).get(60)["result"] == "destroyed"
        # then its pod is deleted all the same (the Foreground delete alone would wait for
        # the GC, pod running), and so is its Secret; only the Job waits for the GC
        ks.env.wait("pod", pod, gone)
        assert ks.env.read("secret", f"{name}-env") is None
        job = ks.env.read("job", name)
        assert job is not None and job["metadata"].get("deletionTimestamp")
    assert ks.lease(lease_id).state == LeaseState.DESTROYED
    ks.env.wait("job", name, gone)


def test_a_job_stuck_terminating_is_reported_and_its_pods_deleted(
        kube_stack: KubeStack, frozen_controllers: Any) -> None:
    # given a Job whose pod runs, whose lease and run records were deleted behind our back
    ks = kube_stack
    acquired = acquire(ks, backend="job", command=LOOP)
    lease_id, name = acquired["lease_id"], acquired["provider_lease_id"]
    pod = job_pod(ks, name)
    ks.forget(lease_id)
    with frozen_controllers():
        # and someone deleting the Job in Foreground while the GC is stuck: it stays
        # terminating, its pod running (this worker's limit is 0 s: stuck at once)
        ks.env.batch.delete_namespaced_job(name, ks.namespace, propagation_policy="Foreground")
        ks.env.wait("job", name, lambda j: bool(j and j["metadata"].get("deletionTimestamp")))
        assert pod_phase_in("Running")(ks.env.read("pod", pod))
        # when sweep.orphans runs
        summary = app.send_task("sweep.orphans").get(60)
        # then it reports the Job, records it as an orphan and destroys it: its pod goes
        assert (summary["stuck_terminating"], summary["recorded"], summary["terminating"]
                ) == (1, 1, 0), summary
        assert any(item.startswith(f"stuck_terminating {name} (terminating since ")
                   for item in summary["items"]), summary
        lease = eventually(lambda: (row := ks.lease(lease_id)).state == LeaseState.DESTROYED
                           and row, "the orphan's destroy")
        assert lease.end_reason == "orphan"
        ks.env.wait("pod", pod, gone)
        assert ks.env.read("secret", f"{name}-env") is None
        assert f"{name} (lease {lease_id}) is still terminating" in ks.worker_log()
    ks.env.wait("job", name, gone)


# -- a part labelled for another lease is no orphan of ours -----------------------------------

def test_an_orphan_destroy_never_deletes_a_secret_labelled_for_another_lease(
        kube_stack: KubeStack) -> None:
    # given a Secret under lease qag82a512's Secret name, labelled with this installation and
    # that lease's workload name but lease id someotherlease (label and annotation), made by
    # hand, older than the orphan grace
    ks = kube_stack
    ks.restart_worker(LEASEKEEPER_ORPHAN_GRACE_S="1")
    name = ks.env.provider.lease_name("qag82a512")
    identity = LeaseIdentity("someotherlease", name, ks.env.installation, "acme")
    manifest = build_secret(identity, SandboxSpec(tenant="acme"), ks.env.provider.defaults,
                            Backend.JOB, "their-token", OwnerRef("v1", "X", "x", "x"))
    del manifest["metadata"]["ownerReferences"]
    theirs = str(ks.env.core.create_namespaced_secret(ks.namespace, manifest).metadata.uid)
    time.sleep(2)  # past the 1 s grace: the sweep takes it
    ks.proxy.reset_counts()
    # when sweep.orphans runs (its labels say this installation's: it is recorded as an
    # orphan, and destroyed)
    summary = app.send_task("sweep.orphans").get(60)
    assert summary["recorded"] == 1, summary
    (lease,) = ks.store.leases()
    eventually(lambda: ks.lease(lease.lease_id).state == LeaseState.DESTROYED,
               "the orphan's destroy")
    # then that destroy sent no DELETE: the Secret is not lease qag82a512's
    assert ks.proxy.count("DELETE") == 0
    assert uid(ks.env.read("secret", f"{name}-env")) == theirs
