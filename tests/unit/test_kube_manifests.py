"""Owns the pure tests of providers/kubernetes: whole manifests from the builders
(manifests.py), names and labels, and the readings of API objects (status.py). No cluster."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import SecretStr

from providers.kubernetes.errors import Permission, translate_api_exception
from providers.kubernetes.manifests import (
    IDLE_COMMAND,
    Backend,
    LeaseIdentity,
    OwnerRef,
    WorkloadDefaults,
    build_job,
    build_sandbox,
    build_secret,
    label_value,
    lease_name,
)
from providers.kubernetes.status import (
    JobPhase,
    SandboxPhase,
    belongs_to,
    container_exit_code,
    controlled_by,
    controlled_by_other,
    job_exit_code,
    job_phase,
    job_stop_reason,
    pick_pod,
    pod_not_running_reason,
    sandbox_pod_hint,
    sandbox_state,
)
from providers.spec import Resources, SandboxSpec

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
DEFAULTS = WorkloadDefaults(
    namespace="sandboxes", image="busybox:1.36", cpu_request="250m", memory_request="512Mi",
    cpu_limit="2", memory_limit="4Gi", sandbox_api_version="v1beta1",
    job_active_deadline_s=3600, job_ttl_after_finished_s=900, lease_ttl_s=3600)
IDENTITY = LeaseIdentity(lease_id="01jabc", name="lk-01jabc", installation="prod",
                         tenant="acme", run_id="run-7", extra_labels=(("team", "core"),))
LABELS = {
    "team": "core",
    "app.kubernetes.io/managed-by": "leasekeeper",
    "leasekeeper.dev/installation": "prod",
    "leasekeeper.dev/lease-id": "01jabc",
    "leasekeeper.dev/tenant": "acme",
    "leasekeeper.dev/workload": "lk-01jabc",
    "leasekeeper.dev/run-id": "run-7",
}
ANNOTATIONS = {"leasekeeper.dev/lease-id": "01jabc"}


def spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(tenant="acme", **kw)


def container(command: list[str] | None, env: list[dict[str, str]] | None = None,
              resources: dict[str, Any] | None = None, image: str = "busybox:1.36") -> Any:
    built: dict[str, Any] = {"name": "sandbox", "image": image}
    if command is not None:
        built["command"] = command
    built["env"] = [{"name": "LEASEKEEPER_LEASE_ID", "value": "01jabc"}, *(env or [])]
    built["envFrom"] = [{"secretRef": {"name": "lk-01jabc-env", "optional": False}}]
    built["resources"] = resources or {"requests": {"cpu": "250m", "memory": "512Mi"},
                                       "limits": {"cpu": "2", "memory": "4Gi"}}
    return built


def test_build_sandbox_is_the_whole_manifest() -> None:
    # given a spec with env and a command; when building; then every field is as expected
    manifest = build_sandbox(IDENTITY, spec(env={"A": "1"}, command=["python", "-V"], ttl_s=60),
                             DEFAULTS, NOW)
    assert manifest == {
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": "lk-01jabc", "namespace": "sandboxes",
                     "labels": {**LABELS, "leasekeeper.dev/backend": "sandbox-cr"},
                     "annotations": ANNOTATIONS},
        "spec": {
            "podTemplate": {
                "metadata": {"labels": {**LABELS, "leasekeeper.dev/backend": "sandbox-cr",
                                        "leasekeeper.dev/role": "sandbox"},
                             "annotations": ANNOTATIONS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [container(["python", "-V"], [{"name": "A", "value": "1"}])],
                },
            },
            "shutdownTime": "2026-01-02T03:15:05Z",  # now + ttl 60 s + 600 s grace
            "shutdownPolicy": "Delete",
        },
    }


def test_build_sandbox_defaults_idle_command_and_api_version() -> None:
    manifest = build_sandbox(IDENTITY, spec(), WorkloadDefaults(**{
        **DEFAULTS.__dict__, "sandbox_api_version": "v1alpha1"}), NOW)
    assert manifest["apiVersion"] == "agents.x-k8s.io/v1alpha1"
    assert manifest["spec"]["podTemplate"]["spec"]["containers"][0]["command"] == IDLE_COMMAND
    assert manifest["spec"]["shutdownTime"] == "2026-01-02T04:14:05Z"
    assert "restartPolicy" not in manifest["spec"]["podTemplate"]["spec"]


def test_build_job_is_the_whole_manifest() -> None:
    resources = Resources(cpu_request="1", memory_limit="8Gi")
    manifest = build_job(IDENTITY, spec(image="python:3.12", resources=resources), DEFAULTS)
    assert manifest == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "lk-01jabc", "namespace": "sandboxes",
                     "labels": {**LABELS, "leasekeeper.dev/backend": "job"},
                     "annotations": ANNOTATIONS},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 900,
            "template": {
                "metadata": {"labels": {**LABELS, "leasekeeper.dev/backend": "job",
                                        "leasekeeper.dev/role": "sandbox"},
                             "annotations": ANNOTATIONS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [container(
                        None, image="python:3.12",
                        resources={"requests": {"cpu": "1", "memory": "512Mi"},
                                   "limits": {"cpu": "2", "memory": "8Gi"}})],
                    "restartPolicy": "Never",
                },
            },
        },
    }


def test_build_secret_is_the_whole_manifest_with_owner_and_token() -> None:
    owner = OwnerRef("batch/v1", "Job", "lk-01jabc", "uid-1")
    manifest = build_secret(IDENTITY, spec(secret_env={"API_KEY": SecretStr("s3cret")}),
                            DEFAULTS, Backend.JOB, "tok-123", owner)
    assert manifest == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "lk-01jabc-env", "namespace": "sandboxes",
            "labels": {**LABELS, "leasekeeper.dev/backend": "job"},
            "annotations": ANNOTATIONS,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "lk-01jabc",
                                 "uid": "uid-1", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "type": "Opaque",
        "stringData": {"API_KEY": "s3cret", "LEASEKEEPER_BOOTSTRAP_TOKEN": "tok-123"},
    }


POOL_IDENTITY = LeaseIdentity(lease_id="01jpool", name="lk-01jpool", installation="prod",
                              tenant="acme", pool="py-small")
POOL_LABELS = {
    "app.kubernetes.io/managed-by": "leasekeeper",
    "leasekeeper.dev/installation": "prod",
    "leasekeeper.dev/lease-id": "01jpool",
    "leasekeeper.dev/tenant": "acme",
    "leasekeeper.dev/workload": "lk-01jpool",
    "leasekeeper.dev/pool": "py-small",
}
POOL_ANNOTATIONS = {"leasekeeper.dev/lease-id": "01jpool"}


def pool_container(command: list[str] | None) -> Any:
    built: dict[str, Any] = {"name": "sandbox", "image": "busybox:1.36"}
    if command is not None:
        built["command"] = command
    built["env"] = [{"name": "LEASEKEEPER_LEASE_ID", "value": "01jpool"},
                    {"name": "LEASEKEEPER_RUN_DIR", "value": "/run/leasekeeper"},
                    {"name": "A", "value": "1"}]
    built["envFrom"] = [{"secretRef": {"name": "lk-01jpool-env", "optional": False}}]
    built["volumeMounts"] = [{"name": "leasekeeper-run", "mountPath": "/run/leasekeeper"}]
    built["resources"] = {"requests": {"cpu": "250m", "memory": "512Mi"},
                          "limits": {"cpu": "2", "memory": "4Gi"}}
    return built


RUN_VOLUME = {"name": "leasekeeper-run", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}}


def test_a_pool_members_sandbox_is_the_whole_manifest_with_its_run_directory() -> None:
    # given a pool member (its spec's env may not shadow the run directory's variable)
    manifest = build_sandbox(POOL_IDENTITY,
                             spec(env={"A": "1", "LEASEKEEPER_RUN_DIR": "/elsewhere"}),
                             DEFAULTS, NOW)
    # then the pod template mounts a memory-backed emptyDir at the run directory, names it
    # in the environment, and every object carries the pool's label
    assert manifest == {
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": {"name": "lk-01jpool", "namespace": "sandboxes",
                     "labels": {**POOL_LABELS, "leasekeeper.dev/backend": "sandbox-cr"},
                     "annotations": POOL_ANNOTATIONS},
        "spec": {
            "podTemplate": {
                "metadata": {"labels": {**POOL_LABELS, "leasekeeper.dev/backend": "sandbox-cr",
                                        "leasekeeper.dev/role": "sandbox"},
                             "annotations": POOL_ANNOTATIONS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [pool_container(IDLE_COMMAND)],
                    "volumes": [RUN_VOLUME],
                },
            },
            "shutdownTime": "2026-01-02T04:14:05Z",
            "shutdownPolicy": "Delete",
        },
    }


def test_a_pool_members_job_is_the_whole_manifest_with_its_run_directory() -> None:
    manifest = build_job(POOL_IDENTITY, spec(env={"A": "1"}, command=["agent"]), DEFAULTS)
    assert manifest == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "lk-01jpool", "namespace": "sandboxes",
                     "labels": {**POOL_LABELS, "leasekeeper.dev/backend": "job"},
                     "annotations": POOL_ANNOTATIONS},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 900,
            "template": {
                "metadata": {"labels": {**POOL_LABELS, "leasekeeper.dev/backend": "job",
                                        "leasekeeper.dev/role": "sandbox"},
                             "annotations": POOL_ANNOTATIONS},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [pool_container(["agent"])],
                    "restartPolicy": "Never",
                    "volumes": [RUN_VOLUME],
                },
            },
        },
    }


def test_a_pool_members_secret_holds_the_bootstrap_token_alone() -> None:
    owner = OwnerRef("batch/v1", "Job", "lk-01jpool", "uid-1")
    manifest = build_secret(POOL_IDENTITY, spec(secret_env={"API_KEY": SecretStr("s3cret")}),
                            DEFAULTS, Backend.JOB, "tok-123", owner)
    assert manifest == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "lk-01jpool-env", "namespace": "sandboxes",
            "labels": {**POOL_LABELS, "leasekeeper.dev/backend": "job"},
            "annotations": POOL_ANNOTATIONS,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "lk-01jpool",
                                 "uid": "uid-1", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "type": "Opaque",
        "stringData": {"LEASEKEEPER_BOOTSTRAP_TOKEN": "tok-123"},
    }


def test_a_pool_name_that_is_no_label_value_is_sanitised() -> None:
    odd = LeaseIdentity(lease_id="01jpool", name="lk-01jpool", installation="prod",
                        tenant="acme", pool="gpu/large pool")
    labels = build_job(odd, spec(), DEFAULTS)["metadata"]["labels"]
    assert labels["leasekeeper.dev/pool"] == label_value("gpu/large pool")
    assert re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", labels["leasekeeper.dev/pool"])


def test_without_a_pool_a_spec_env_named_like_the_run_directory_is_kept() -> None:
    # leases outside pools get exactly the manifests they always did
    manifest = build_job(IDENTITY, spec(env={"LEASEKEEPER_RUN_DIR": "/mine"}), DEFAULTS)
    pod_spec = manifest["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["env"][1] == {"name": "LEASEKEEPER_RUN_DIR",
                                                   "value": "/mine"}
    assert "volumes" not in pod_spec and "volumeMounts" not in pod_spec["containers"][0]
    assert "leasekeeper.dev/pool" not in manifest["metadata"]["labels"]


def test_secret_values_never_reach_the_workload_manifest() -> None:
    secret_spec = spec(secret_env={"API_KEY": SecretStr("s3cret")})
    for manifest in (build_sandbox(IDENTITY, secret_spec, DEFAULTS, NOW),
                     build_job(IDENTITY, secret_spec, DEFAULTS)):
        assert "s3cret" not in repr(manifest)


def test_the_bootstrap_token_wins_over_a_secret_env_of_the_same_name() -> None:
    # A spec may not name it (providers/spec.py RESERVED_ENV); were one built without that
    # check, the token still wins.
    with pytest.raises(ValueError, match="leasekeeper sets this variable"):
        spec(secret_env={"LEASEKEEPER_BOOTSTRAP_TOKEN": SecretStr("mine")})
    owner = OwnerRef("batch/v1", "Job", "lk-01jabc", "uid-1")
    unchecked = SandboxSpec.model_construct(
        tenant="acme", secret_env={"LEASEKEEPER_BOOTSTRAP_TOKEN": SecretStr("mine")})
    manifest = build_secret(IDENTITY, unchecked, DEFAULTS, Backend.JOB, "tok", owner)
    assert manifest["stringData"] == {"LEASEKEEPER_BOOTSTRAP_TOKEN": "tok"}


def test_builders_are_pure() -> None:
    args = (IDENTITY, spec(env={"A": "1"}), DEFAULTS)
    assert build_sandbox(*args, NOW) == build_sandbox(*args, NOW)
    assert build_job(*args) == build_job(*args)


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.mark.parametrize("lease_id", [
    "01jabc", "01JABCDEFGHJKMNPQRSTVWXYZ0", "a:b.c_d", "x" * 64, "A", "a--b", "-", "Z" * 40,
])
def test_lease_name_is_dns_safe_short_and_deterministic(lease_id: str) -> None:
    name = lease_name(lease_id)
    assert DNS_LABEL.fullmatch(name), name
    assert len(name) <= 52 and len(name + "-env") <= 63
    assert name == lease_name(lease_id)


def test_lease_name_keeps_simple_ids_and_separates_lossy_ones() -> None:
    assert lease_name("01jabc") == "lk-01jabc"
    assert lease_name("ABC") != lease_name("abc")
    assert lease_name("a:b") != lease_name("a.b")
    assert lease_name("x" * 64) != lease_name("x" * 63)


def test_label_value_sanitises_with_a_hash_only_when_needed() -> None:
    assert label_value("run-7") == "run-7"
    odd = label_value("run:7/x")
    assert re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", odd)
    assert odd != label_value("run-7-x") and len(label_value("r" * 100)) <= 63


# -- status.py ------------------------------------------------------------------------------

def sandbox(conditions: list[dict[str, str]] | None = None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "sb", **extra.pop("metadata", {})},
                           "status": {"conditions": conditions or [], **extra}}
    return obj


@pytest.mark.parametrize(("obj", "phase"), [
    (sandbox([{"type": "Ready", "status": "True"}]), SandboxPhase.READY),
    (sandbox(phase="Ready"), SandboxPhase.READY),
    (sandbox([{"type": "Ready", "status": "False", "reason": "DependenciesNotReady"}]),
     SandboxPhase.PENDING),
    (sandbox(), SandboxPhase.PENDING),
    (sandbox([{"type": "Ready", "status": "False", "reason": "PodFailed"}]), SandboxPhase.FAILED),
    (sandbox([{"type": "Ready", "status": "False", "reason": "SandboxExpired"}]),
     SandboxPhase.FAILED),
    (sandbox([{"type": "Failed", "status": "True", "reason": "Boom"}]), SandboxPhase.FAILED),
    (sandbox(phase="Failed"), SandboxPhase.FAILED),
    (sandbox([{"type": "Finished", "status": "True", "reason": "PodSucceeded"}]),
     SandboxPhase.FAILED),
    (sandbox([{"type": "Ready", "status": "True"}],
             metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}), SandboxPhase.TERMINATING),
    # the controller's pod was refused as invalid (422): refused again on every try
    (sandbox([{"type": "Ready", "status": "False", "reason": "ReconcilerError",
               "message": 'creating the pod failed: {"kind":"Status","message":"Pod \\"lk-1\\" '
                          'is invalid: spec.containers[0].image: Invalid value"}'}]),
     SandboxPhase.FAILED),
    # a transient reconcile error (the API server was unavailable) is still pending
    (sandbox([{"type": "Ready", "status": "False", "reason": "ReconcilerError",
               "message": "creating the pod failed: the server is currently unable to handle "
                          "the request"}]), SandboxPhase.PENDING),
])
def test_sandbox_state(obj: dict[str, Any], phase: SandboxPhase) -> None:
    assert sandbox_state(obj).phase is phase


def test_sandbox_failure_reason_names_the_condition() -> None:
    state = sandbox_state(sandbox([{"type": "Ready", "status": "False", "reason": "PodFailed",
                                    "message": "exit 3"}]))
    assert "PodFailed" in state.reason and "exit 3" in state.reason


@pytest.mark.parametrize(("status", "phase"), [
    ({"conditions": [{"type": "Failed", "status": "True"}]}, JobPhase.FAILED),
    ({"failed": 1, "active": 1}, JobPhase.FAILED),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, JobPhase.SUCCEEDED),
    ({"succeeded": 1}, JobPhase.SUCCEEDED),
    ({"active": 1}, JobPhase.RUNNING),
    ({}, JobPhase.PENDING),
])
def test_job_phase(status: dict[str, Any], phase: JobPhase) -> None:
    assert job_phase({"status": status}) is phase


def pod(name: str, phase: str, created: str = "2026-01-01T00:00:00Z", owner: str | None = None,
        terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": created}
    if owner:
        meta["ownerReferences"] = [{"uid": owner, "controller": True}]
    if terminating:
        meta["deletionTimestamp"] = created
    return {"metadata": meta, "status": {"phase": phase}}


def test_pick_pod_prefers_running_then_alive_then_newest_and_checks_the_owner() -> None:
    pods = [pod("a", "Pending", "2026-01-03T00:00:00Z", owner="mine"),
            pod("b", "Running", owner="mine"),
            pod("c", "Running", "2026-01-02T00:00:00Z", owner="mine", terminating=True)]
    assert pick_pod(pods, "mine") == pods[1]
    assert pick_pod([pod("x", "Running", owner="other")], owner_uid="mine") is None
    assert pick_pod([pod("bare", "Running")], owner_uid="mine") is None  # made by hand
    assert pick_pod([], "mine") is None


def test_pod_reasons_and_exit_codes() -> None:
    assert pod_not_running_reason(pod("p", "Running")) is None
    assert pod_not_running_reason(pod("p", "Pending")) == "Pod p is Pending"
    assert pod_not_running_reason(pod("p", "Running", terminating=True)) == "Pod p is terminating"
    done = {"status": {"containerStatuses": [
        {"name": "sandbox", "state": {"terminated": {"exitCode": 3}}}]}}
    assert container_exit_code(done) == 3
    assert container_exit_code({"status": {}}) is None


def test_pod_hint_and_ownership() -> None:
    assert sandbox_pod_hint({"metadata": {"annotations": {"agents.x-k8s.io/pod-name": "p"}}}) == "p"
    assert sandbox_pod_hint({"metadata": {}, "status": {"podName": "q"}}) == "q"
    assert sandbox_pod_hint({"metadata": {}}) is None
    ours = {"metadata": {"labels": {"leasekeeper.dev/installation": "prod",
                                    "leasekeeper.dev/lease-id": "01jabc"},
                         "annotations": {"leasekeeper.dev/lease-id": "01jabc"}}}
    assert belongs_to(ours, "01jabc", "prod")
    assert not belongs_to(ours, "01jabc", "staging")
    assert not belongs_to(ours, "01jabd", "prod")


def owned(*refs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "x", "ownerReferences": list(refs)}}


def test_only_the_controller_reference_says_whose_an_object_is() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "name": "lk-a", "uid": "job-uid",
           "controller": True}
    sandbox = {"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox", "name": "lk-a",
               "uid": "sb-uid", "controller": True}
    replica_set = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8",
                   "uid": "rs-uid", "controller": True}
    # a pod counts for a workload only if that workload's uid is its controller
    assert controlled_by(owned(job), "job-uid")
    assert not controlled_by(owned(job), "other-uid")
    assert not controlled_by(owned(), "job-uid")  # a bare pod (made by hand)
    assert not controlled_by(owned({**job, "controller": False}), "job-uid")
    assert not controlled_by(owned(job), None)
    # something else controlling it makes an object not ours, whatever its labels
    assert not controlled_by_other(owned(), "lk-a")
    assert not controlled_by_other(owned(job), "lk-a")
    assert not controlled_by_other(owned(sandbox), "lk-a")
    assert not controlled_by_other(owned({**replica_set, "controller": False}), "lk-a")
    assert controlled_by_other(owned(replica_set), "lk-a")
    assert controlled_by_other(owned(job), "lk-b")
    assert controlled_by_other(owned({**job, "apiVersion": "example.com/v1"}), "lk-a")

def exited(name: str, code: int, created: str, owner: str = "job-uid",
           terminating: bool = False) -> dict[str, Any]:
    done = pod(name, "Failed" if code else "Succeeded", created, owner, terminating)
    done["status"]["containerStatuses"] = [
        {"name": "sandbox", "state": {"terminated": {"exitCode": code}}}]
    return done


def test_job_exit_code_is_the_newest_own_pod_that_ended_by_itself() -> None:
    failed = {"metadata": {"uid": "job-uid"}, "status": {"failed": 1}}
    pods = [exited("old", 1, "2026-01-01T00:00:00Z"), exited("new", 7, "2026-01-02T00:00:00Z"),
            exited("foreign", 9, "2026-01-03T00:00:00Z", owner="other"),
            exited("killed", 143, "2026-01-04T00:00:00Z", terminating=True)]
    assert job_exit_code(failed, pods) == 7
    assert job_exit_code({"metadata": {"uid": "job-uid"}, "status": {"succeeded": 1}},
                         [exited("ok", 0, "2026-01-01T00:00:00Z")]) == 0
    # still running, or finished with no code of its own: unknown, never "finished"
    assert job_exit_code({"metadata": {"uid": "job-uid"}, "status": {"active": 1}}, pods) is None
    assert job_exit_code(failed, [pod("gone", "Failed", owner="job-uid")]) is None
    assert job_exit_code(failed, [pods[3]]) is None


@pytest.mark.parametrize(("condition", "reason"), [
    ({"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}, "DeadlineExceeded"),
    # failed by its own pod (which has an exit code), or not failed: no stop reason
    ({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}, None),
    ({"type": "Failed", "status": "False", "reason": "DeadlineExceeded"}, None),
    ({"type": "Complete", "status": "True"}, None),
])
def test_job_stop_reason_only_for_a_job_kubernetes_stopped(condition: dict[str, str],
                                                           reason: str | None) -> None:
    assert job_stop_reason({"status": {"conditions": [condition]}}) == reason


def test_a_403_names_the_verb_resource_and_group_to_grant() -> None:
    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=403, reason="Forbidden")
    error = translate_api_exception(
        "watch sandbox-cr ns/lk-x", exc, sensitive=False, namespace="ns",
        permission=Permission("watch", "sandboxes", "agents.x-k8s.io"))
    text = str(error)
    assert text.startswith("kubernetes: watch sandbox-cr ns/lk-x failed (HTTP 403 Forbidden)")
    assert 'add verb "watch" on resource "sandboxes"' in text
    assert '"agents.x-k8s.io"' in text and "deploy/rbac/role.yaml" in text and "RBAC" in text
