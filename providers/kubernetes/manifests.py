"""Pure builders for every object the Kubernetes provider creates: names, labels, selectors
and the Sandbox / Job / Secret manifests. No I/O, no clock, no randomness: ``now`` and the
bootstrap token are passed in, so each builder is a function of its arguments and tests
compare whole manifests.

Order of creation (see provider.py): the workload (Sandbox or Job) first, then its Secret
``<name>-env`` with an ownerReference to the uid the create returned. The pod reads the
Secret through ``envFrom`` with ``optional: false``, so the kubelet does not start the
container before the Secret exists.

A warm pool member (``LeaseIdentity.pool``) also carries the label ``leasekeeper.dev/pool``
on every object, and its sandbox container gets the run directory: a memory-backed
``emptyDir`` mounted at ``RUN_DIR_PATH``, named by ``$LEASEKEEPER_RUN_DIR``, which a claim
fills with its run's data (delivery.py). Its Secret holds the bootstrap token only: a run's
secrets reach the member at claim time, never through a manifest. Leases without a pool get
exactly the manifests they always did.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from providers.base import RUN_DIR_ENV
from providers.spec import MANAGED_BY_LABEL, QUANTITY, SandboxSpec, echo, quantity_value

if TYPE_CHECKING:
    from workers.settings import Settings

Manifest = dict[str, Any]

SANDBOX_GROUP = "agents.x-k8s.io"
SANDBOX_KIND = "Sandbox"
SANDBOX_PLURAL = "sandboxes"
JOB_API_VERSION = "batch/v1"

LABEL_INSTALLATION = "leasekeeper.dev/installation"
LABEL_LEASE_ID = "leasekeeper.dev/lease-id"
LABEL_RUN_ID = "leasekeeper.dev/run-id"
LABEL_TENANT = "leasekeeper.dev/tenant"
LABEL_WORKLOAD = "leasekeeper.dev/workload"
LABEL_BACKEND = "leasekeeper.dev/backend"
LABEL_ROLE = "leasekeeper.dev/role"
LABEL_POOL = "leasekeeper.dev/pool"
LABEL_MANAGED_BY = MANAGED_BY_LABEL
MANAGED_BY = "leasekeeper"
ROLE_SANDBOX = "sandbox"
ANNOTATION_LEASE_ID = "leasekeeper.dev/lease-id"

# Set by others: the agent-sandbox controller and the Job controller.
SANDBOX_POD_ANNOTATION = "agents.x-k8s.io/pod-name"
SANDBOX_NAME_LABEL = "agents.x-k8s.io/sandbox-name"
JOB_NAME_LABEL = "job-name"
JOB_UID_LABEL = "controller-uid"

BOOTSTRAP_TOKEN_ENV = "LEASEKEEPER_BOOTSTRAP_TOKEN"  # noqa: S105 - a variable name
LEASE_ID_ENV = "LEASEKEEPER_LEASE_ID"
CONTAINER_NAME = "sandbox"
SECRET_SUFFIX = "-env"  # noqa: S105 - a name suffix
# A Sandbox pod must stay up until destroyed; a Job without a command runs the image's own.
IDLE_COMMAND = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
# A pool member's run directory: tmpfs (never on the node's disk), private to its pod. 4 MiB
# holds the largest run a spec allows (128 KiB of env and secrets, sh-quoted at most 4x) twice
# over, as a repeated claim's temporary copy needs; it counts against the memory limit.
RUN_VOLUME = "leasekeeper-run"
RUN_DIR_PATH = "/run/leasekeeper"
RUN_DIR_SIZE_LIMIT = "4Mi"

NAME_PREFIX = "lk-"
# <name>-env and the job-name / sandbox-name labels must stay within 63 characters.
NAME_MAX = 52
_LABEL_VALUE_MAX = 63
_DNS_UNSAFE = re.compile(r"[^a-z0-9-]+")
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Backend(StrEnum):
    SANDBOX_CR = "sandbox-cr"
    JOB = "job"


def backend_refusal(raw: str | None) -> str | None:
    """Why ``raw`` (a spec's backend) is no backend of the Kubernetes provider, or None if
    it is one (or unset: LEASEKEEPER_KUBE_BACKEND's). One wording for the worker's check of
    a spec and the producer's."""
    if raw is None or raw in tuple(Backend):
        return None
    return (f"kubernetes: unknown backend {echo(raw)}; use 'sandbox-cr' or 'job' (or leave "
            "backend unset for LEASEKEEPER_KUBE_BACKEND's)")


def _digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()[:8]


def lease_name(lease_id: str) -> str:
    """``lk-<slug>``: DNS-1123 label safe, at most NAME_MAX characters, deterministic.

    When the slug loses information (case, characters, length) a hash of the whole id is
    appended, so two ids never share a name.
    """
    slug = _DNS_UNSAFE.sub("-", lease_id.lower()).strip("-")
    room = NAME_MAX - len(NAME_PREFIX)
    if slug == lease_id and len(slug) <= room:
        return NAME_PREFIX + slug
    return f"{NAME_PREFIX}{slug[: room - 9].rstrip('-')}-{_digest(lease_id)}".replace("--", "-")


def secret_name(name: str) -> str:
    return name + SECRET_SUFFIX


def label_value(raw: str) -> str:
    """``raw`` as a valid label value; lossy conversions get a hash suffix."""
    if len(raw) <= _LABEL_VALUE_MAX and _LABEL_NAME.fullmatch(raw):
        return raw
    slug = _LABEL_UNSAFE.sub("-", raw).strip("-_.")
    return f"{slug[: _LABEL_VALUE_MAX - 9].rstrip('-_.')}-{_digest(raw)}".lstrip("-")


def is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return bool(_LABEL_NAME.fullmatch(name))


def installation_selector(installation: str) -> str:
    return f"{LABEL_INSTALLATION}={installation}"


@dataclass(frozen=True)
class WorkloadDefaults:
    """What settings contribute to a manifest (so builders never read settings)."""

    namespace: str
    image: str
    cpu_request: str
    memory_request: str
    cpu_limit: str
    memory_limit: str
    sandbox_api_version: str = "v1alpha1"
    job_active_deadline_s: int = 3600
    job_ttl_after_finished_s: int = 900
    lease_ttl_s: int = 3600
    # The Sandbox's shutdownTime is a backstop: the lease's own deadline plus this grace,
    # so the store's expiry sweep acts first and a lost lease still cannot run forever.
    shutdown_grace_s: int = 600

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkloadDefaults:
        return cls(
            namespace=settings.kube_namespace,
            image=settings.kube_default_image,
            cpu_request=settings.kube_cpu_request,
            memory_request=settings.kube_memory_request,
            cpu_limit=settings.kube_cpu_limit,
            memory_limit=settings.kube_memory_limit,
            sandbox_api_version=settings.kube_sandbox_api_version,
            job_active_deadline_s=settings.kube_job_active_deadline_s,
            job_ttl_after_finished_s=settings.kube_job_ttl_after_finished_s,
            lease_ttl_s=settings.lease_ttl_s,
        )

    @property
    def sandbox_api_group_version(self) -> str:
        return f"{SANDBOX_GROUP}/{self.sandbox_api_version}"


@dataclass(frozen=True)
class LeaseIdentity:
    """Who a set of objects belongs to; every object carries it as labels."""

    lease_id: str
    name: str
    installation: str
    tenant: str
    run_id: str | None = None
    extra_labels: tuple[tuple[str, str], ...] = ()
    pool: str | None = None  # the warm pool this sandbox is created for


@dataclass(frozen=True)
class OwnerRef:
    api_version: str
    kind: str
    name: str
    uid: str

    def manifest(self) -> Manifest:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def workload_api_version(backend: Backend, defaults: WorkloadDefaults) -> str:
    match backend:
        case Backend.SANDBOX_CR:
            return defaults.sandbox_api_group_version
        case Backend.JOB:
            return JOB_API_VERSION


def workload_kind(backend: Backend) -> str:
    match backend:
        case Backend.SANDBOX_CR:
            return SANDBOX_KIND
        case Backend.JOB:
            return "Job"


def build_labels(identity: LeaseIdentity, backend: Backend) -> dict[str, str]:
    """The labels every object of the lease carries (caller labels first, ours win)."""
    labels = dict(identity.extra_labels)
    labels.update({
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_INSTALLATION: identity.installation,
        LABEL_LEASE_ID: label_value(identity.lease_id),
        LABEL_TENANT: identity.tenant,
        LABEL_WORKLOAD: identity.name,
        LABEL_BACKEND: backend.value,
    })
    if identity.run_id:
        labels[LABEL_RUN_ID] = label_value(identity.run_id)
    if identity.pool:
        labels[LABEL_POOL] = label_value(identity.pool)
    return labels


def build_annotations(identity: LeaseIdentity) -> dict[str, str]:
    """Exact values that labels can only carry in a sanitised form."""
    return {ANNOTATION_LEASE_ID: identity.lease_id}


def build_metadata(identity: LeaseIdentity, backend: Backend, namespace: str, name: str,
                   **extra: Any) -> Manifest:
    return {
        "name": name,
        "namespace": namespace,
        "labels": build_labels(identity, backend),
        "annotations": build_annotations(identity),
        **extra,
    }


def resources_refusal(spec: SandboxSpec, defaults: WorkloadDefaults) -> str | None:
    """Why the pod's requests and limits, as the manifest will carry them (the spec's, else
    the settings' defaults), are ones Kubernetes refuses (a request over its limit), or
    None. A spec's request and limit both given are compared by the spec's own validation;
    a default that is no quantity is left to the API server to name."""
    res = spec.resources
    for kind in ("cpu", "memory"):
        mine_request = res and getattr(res, f"{kind}_request")
        mine_limit = res and getattr(res, f"{kind}_limit")
        if mine_request and mine_limit:
            continue
        request = mine_request or getattr(defaults, f"{kind}_request")
        limit = mine_limit or getattr(defaults, f"{kind}_limit")
        if not (QUANTITY.fullmatch(request) and QUANTITY.fullmatch(limit)):
            continue
        if quantity_value(request) <= quantity_value(limit):
            continue
        setting = f"LEASEKEEPER_KUBE_{kind.upper()}"
        if mine_request:
            return (f"kubernetes: resources.{kind}_request {request} is more than the default "
                    f"{kind} limit {limit} ({setting}_LIMIT; the spec sets no {kind}_limit), "
                    f"and Kubernetes refuses such a pod: ask for at most {limit}, or set "
                    f"resources.{kind}_limit too")
        if mine_limit:
            return (f"kubernetes: resources.{kind}_limit {limit} is less than the default "
                    f"{kind} request {request} ({setting}_REQUEST; the spec sets no "
                    f"{kind}_request), and Kubernetes refuses such a pod: set "
                    f"resources.{kind}_request too, at most {limit}")
        return (f"kubernetes: the default {kind} request {request} ({setting}_REQUEST) is "
                f"more than the default {kind} limit {limit} ({setting}_LIMIT), and Kubernetes "
                f"refuses such a pod: fix the settings, or set resources.{kind}_request and "
                f"{kind}_limit in the spec")
    return None


def build_container(identity: LeaseIdentity, spec: SandboxSpec, defaults: WorkloadDefaults,
                    backend: Backend) -> Manifest:
    res = spec.resources
    container: Manifest = {
        "name": CONTAINER_NAME,
        "image": spec.image or defaults.image,
    }
    command = spec.command or (IDLE_COMMAND if backend is Backend.SANDBOX_CR else None)
    if command:
        container["command"] = list(command)
    ours = [{"name": LEASE_ID_ENV, "value": identity.lease_id}]
    if identity.pool:
        ours.append({"name": RUN_DIR_ENV, "value": RUN_DIR_PATH})
    reserved = {var["name"] for var in ours}
    container["env"] = [
        *ours,
        *({"name": key, "value": value} for key, value in spec.env.items() if key not in reserved),
    ]
    container["envFrom"] = [{"secretRef": {"name": secret_name(identity.name), "optional": False}}]
    if identity.pool:
        container["volumeMounts"] = [{"name": RUN_VOLUME, "mountPath": RUN_DIR_PATH}]
    container["resources"] = {
        "requests": {
            "cpu": (res and res.cpu_request) or defaults.cpu_request,
            "memory": (res and res.memory_request) or defaults.memory_request,
        },
        "limits": {
            "cpu": (res and res.cpu_limit) or defaults.cpu_limit,
            "memory": (res and res.memory_limit) or defaults.memory_limit,
        },
    }
    return container


def build_pod_template(identity: LeaseIdentity, spec: SandboxSpec, defaults: WorkloadDefaults,
                       backend: Backend) -> Manifest:
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [build_container(identity, spec, defaults, backend)],
    }
    if backend is Backend.JOB:
        pod_spec["restartPolicy"] = "Never"
    if identity.pool:
        pod_spec["volumes"] = [build_run_volume()]
    labels = build_labels(identity, backend)
    labels[LABEL_ROLE] = ROLE_SANDBOX
    return {
        "metadata": {"labels": labels, "annotations": build_annotations(identity)},
        "spec": pod_spec,
    }


def build_run_volume() -> Manifest:
    """A pool member's run directory: memory-backed, small, gone with its pod."""
    return {"name": RUN_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": RUN_DIR_SIZE_LIMIT}}


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_sandbox(identity: LeaseIdentity, spec: SandboxSpec, defaults: WorkloadDefaults,
                  now: datetime) -> Manifest:
    """An agent-sandbox ``Sandbox`` that deletes itself a grace period after the lease ends."""
    ttl_s = spec.ttl_s or defaults.lease_ttl_s
    shutdown = now + timedelta(seconds=ttl_s + defaults.shutdown_grace_s)
    return {
        "apiVersion": defaults.sandbox_api_group_version,
        "kind": SANDBOX_KIND,
        "metadata": build_metadata(identity, Backend.SANDBOX_CR, defaults.namespace,
                                   identity.name),
        "spec": {
            "podTemplate": build_pod_template(identity, spec, defaults, Backend.SANDBOX_CR),
            "shutdownTime": _rfc3339(shutdown),
            "shutdownPolicy": "Delete",
        },
    }


def build_job(identity: LeaseIdentity, spec: SandboxSpec, defaults: WorkloadDefaults) -> Manifest:
    """A batch Job that runs once (no retries) and is bounded by its active deadline."""
    return {
        "apiVersion": JOB_API_VERSION,
        "kind": "Job",
        "metadata": build_metadata(identity, Backend.JOB, defaults.namespace, identity.name),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": spec.ttl_s or defaults.job_active_deadline_s,
            "ttlSecondsAfterFinished": defaults.job_ttl_after_finished_s,
            "template": build_pod_template(identity, spec, defaults, Backend.JOB),
        },
    }


def build_secret(identity: LeaseIdentity, spec: SandboxSpec, defaults: WorkloadDefaults,
                 backend: Backend, bootstrap_token: str, owner: OwnerRef) -> Manifest:
    """The per-run Secret: bootstrap token plus the spec's secret env, owned by the workload.
    A pool member's holds the bootstrap token alone (its run's secrets come with the claim).

    The returned manifest holds secret values: never log it.
    """
    string_data: dict[str, str] = {} if identity.pool else dict(spec.secret_values())
    string_data[BOOTSTRAP_TOKEN_ENV] = bootstrap_token
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": build_metadata(identity, backend, defaults.namespace,
                                   secret_name(identity.name),
                                   ownerReferences=[owner.manifest()]),
        "type": "Opaque",
        "stringData": string_data,
    }

