"""``KubernetesProvider``: the lease lifecycle on Kubernetes, for both backends
(``sandbox-cr``: an agent-sandbox Sandbox; ``job``: a batch Job), each with a per-run
Secret ``<name>-env``.

    acquire       workload (409 → adopt if ours; gone by the read → create again, a few
                  times), then Secret (owner = the workload's uid),
                  then wait: Sandbox Ready through one watch (its pod named from it); Job
                  exists (Pending is fine). 3 requests for a Sandbox, 2 for a Job.
                  A warm pool member (``request.pool``) must be claimable once acquired:
                  a Job's waits (list + watch) until its pod is Running, and names it.
                  Any failure after the workload exists runs destroy before re-raising.
    resume_check  checkLeaseResumable of the seed: expected states never raise.
                  The workload must be the lease's (the uid acquire recorded, or this
                  installation's labels for its name, no other controller): anything else
                  under its name is gone. A pod counts only if the workload controls it.
    claim         a pool member taken by a run: workload and pod read (not claimable:
                  NOT_RESUMABLE, never an error; a workload that is not the lease's is
                  gone), then one exec into the sandbox container
                  that writes the run's data into its run directory from stdin
                  (delivery.py). 2 requests and the exec.
    job_exit      a Job's phase and its container's exit code.
    destroy       workload (Foreground), its pods (listed by our labels), Secret; every
                  part attempted, 404 = done. Each object is deleted by the uid recorded
                  at acquire or, failing that, only if it passes acquire's test (``_ours``:
                  its installation and lease-id labels and annotation name this lease, the
                  one whose name it is) (then by the uid just read): anyone else's object,
                  never, not even a DELETE, nor one that another controller owns (a
                  Deployment's pod that copied our labels).
    list_managed  everything carrying this installation's label, one entry per workload,
                  with a finished Job's exit code (or why it ended without one) for
                  sweep.finish_exited, and whether it is stuck terminating.

Manifests come from manifests.py, readings of objects from status.py, API calls from
client.py (which translates every error); this module only decides.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple

from providers.base import (
    Acquired,
    AcquireOutcome,
    AcquireRequest,
    Claimed,
    ClaimOutcome,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
    ManagedResource,
    Meta,
    ResumeResult,
)
from providers.errors import (
    AcquireCleanupIncomplete,
    DestroyIncomplete,
    InvalidRequest,
    PartFailure,
    ProviderConflict,
    ProviderError,
    TerminalProviderError,
    TransientProviderError,
)
from providers.kubernetes.client import KubeApi, Obj, build_api_client
from providers.kubernetes.delivery import DELIVERY_EXITS, DELIVERY_FAILED_HINT, build_delivery
from providers.kubernetes.errors import (
    KubeAlreadyExists,
    KubeCommandFailed,
    KubeCommandInterrupted,
    KubeNotFound,
)
from providers.kubernetes.job_start import JobStart, job_start, pod_refused
from providers.kubernetes.manifests import (
    ANNOTATION_LEASE_ID,
    CONTAINER_NAME,
    DNS_LABEL,
    JOB_NAME_LABEL,
    JOB_UID_LABEL,
    LABEL_BACKEND,
    LABEL_INSTALLATION,
    LABEL_LEASE_ID,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_RUN_ID,
    LABEL_WORKLOAD,
    NAME_MAX,
    SANDBOX_NAME_LABEL,
    Backend,
    LeaseIdentity,
    OwnerRef,
    WorkloadDefaults,
    backend_refusal,
    build_job,
    build_sandbox,
    build_secret,
    installation_selector,
    is_label_key,
    label_value,
    resources_refusal,
    secret_name,
    workload_api_version,
    workload_kind,
)
from providers.kubernetes.manifests import lease_name as _lease_name
from providers.kubernetes.status import (
    JobPhase,
    SandboxPhase,
    belongs_to,
    container_waiting,
    controlled_by,
    controlled_by_other,
    controller_said,
    created_at,
    is_terminating,
    job_exit_code,
    job_phase,
    job_stop_reason,
    labels_of,
    meta,
    name_of,
    owner_uids,
    pick_pod,
    pod_cannot_start,
    pod_not_running_reason,
    pod_phase,
    sandbox_pod_hint,
    sandbox_state,
    terminating_since,
    uid_of,
)
from providers.kubernetes.waits import WaitOutcome, WaitResult, wait_for
from providers.spec import SandboxSpec, echo

if TYPE_CHECKING:
    from workers.settings import Settings

log = logging.getLogger("leasekeeper.kubernetes")
RUN_ID_KEYS = (LABEL_RUN_ID, "run_id", "run-id")
_RESERVED_PREFIXES = ("leasekeeper.dev/", LABEL_MANAGED_BY)
# Creates of a lease's workload when each 409 is followed by a 404 on the read.
_CREATE_ATTEMPTS = 3


class JobExit(NamedTuple):
    phase: JobPhase
    exit_code: int | None


class _NotOurs(ProviderConflict):
    """An object acquire needs exists under our name and belongs to someone else."""


@dataclass(frozen=True)
class _Workload:
    obj: Obj
    outcome: AcquireOutcome


@dataclass(frozen=True)
class _SecretTarget:
    name: str
    uid: str
    recorded: bool  # the uid acquire recorded (it may have been replaced since)


@dataclass(frozen=True)
class _PodLookup:
    pod: Obj | None
    reason: str = "Sandbox is Ready but no backing pod was found"  # why there is none


@dataclass(frozen=True)
class _Claimable:
    """A pool member's pod, Running, ready to take its run's data."""

    pod: str


def _not_claimable(reason: str) -> Claimed:
    return Claimed(ClaimOutcome.NOT_RESUMABLE, reason)


def _pod_started_or_ended(pod: Obj) -> bool:
    """A Job pod's wait is over: it runs, it ended, or it is going away."""
    return pod_phase(pod) in ("Running", "Succeeded", "Failed") or is_terminating(pod)


class KubernetesProvider:
    name = "kubernetes"

    def __init__(self, api: KubeApi, defaults: WorkloadDefaults, installation: str,
                 default_backend: Backend = Backend.SANDBOX_CR, *,
                 terminating_limit_s: float = 600.0, job_pod_wait_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 token_factory: Callable[[], str] = lambda: secrets.token_urlsafe(32)) -> None:
        self.api = api
        self.defaults = defaults
        self.installation = installation
        self.default_backend = default_backend
        self.terminating_limit_s = terminating_limit_s
        self.job_pod_wait_s = job_pod_wait_s
        self._clock = clock
        self._now = now
        self._token = token_factory

    # -- naming -------------------------------------------------------------------------
    def lease_name(self, lease_id: str) -> str:
        return _lease_name(lease_id)

    def check_spec(self, spec: SandboxSpec) -> None:
        """A backend this provider has, and requests within the limits the manifest will
        carry (the spec's, else the settings'); the image's command is only known to the
        cluster."""
        problem = backend_refusal(spec.backend) or resources_refusal(spec, self.defaults)
        if problem:
            raise TerminalProviderError(problem)

    def _backend(self, raw: str | None) -> Backend:
        try:
            return Backend(raw or self.default_backend)
        except ValueError:  # check_spec refuses it first; a lease row's, or a direct call's
            raise TerminalProviderError(backend_refusal(raw) or repr(raw)) from None

    def _api_for(self, handle_meta: Meta) -> KubeApi:
        namespace = str(handle_meta.get("namespace") or self.api.namespace)
        api_version = str(handle_meta.get("api_version") or "")
        version = api_version.rpartition("/")[2] if api_version.startswith("agents.") else ""
        if namespace == self.api.namespace and version in ("", self.api.sandbox_api_version):
            return self.api
        return KubeApi(self.api.api_client, namespace, self.api.request_timeout_s,
                       version or self.api.sandbox_api_version)

    def _identity(self, request: AcquireRequest) -> LeaseIdentity:
        if len(request.name) > NAME_MAX or not DNS_LABEL.fullmatch(request.name):
            raise InvalidRequest(
                f"kubernetes: lease name {request.name!r} is not a DNS-1123 label of at most "
                f"{NAME_MAX} characters; use provider.lease_name(lease_id)")
        labels = {**request.spec.labels, **request.labels}
        run_id = next((labels.pop(k) for k in RUN_ID_KEYS if k in labels), None)
        for key in list(labels):
            if key.startswith(_RESERVED_PREFIXES):
                labels.pop(key)
            elif not is_label_key(key):
                raise InvalidRequest(f"kubernetes: {key!r} is not a valid label key")
        if request.pool is not None and request.spec.secret_env:
            raise InvalidRequest(
                f"kubernetes: pool {request.pool!r}: a pool member's spec carries no secret_env "
                "(a run's secrets reach the member when it is claimed); remove it from the "
                "pool's template")
        return LeaseIdentity(
            lease_id=request.lease_id, name=request.name, installation=self.installation,
            tenant=label_value(request.spec.tenant), run_id=run_id,
            extra_labels=tuple(sorted((k, label_value(v)) for k, v in labels.items())),
            pool=request.pool)

    # -- acquire ------------------------------------------------------------------------
    def acquire(self, request: AcquireRequest) -> Acquired:
        deadline = self._clock() + request.timeout_s
        backend = self._backend(request.spec.backend)
        identity = self._identity(request)
        workload = self._create_or_adopt(backend, identity, request, deadline)
        info = self._meta(backend, workload.obj, pod_name=None)
        if request.pool is not None:
            info["pool"] = request.pool
        try:
            try:
                info["secret_uid"] = self._ensure_secret(backend, identity, request,
                                                         workload.obj)
            except _NotOurs:
                info["secret_name"] = None  # the cleanup below must leave that Secret alone
                raise
            match backend:
                case Backend.SANDBOX_CR:
                    info["pod_name"] = self._await_sandbox(workload.obj, deadline,
                                                           request.timeout_s)
                case Backend.JOB if request.pool is not None:
                    # A pool member is claimed by an exec into its pod: it must run first.
                    # A pod the API server refuses never runs: the controller's word on it
                    # ends that wait at once instead of at the acquire's timeout.
                    self._check_job_start(workload.obj, deadline, request.name)
                    info["pod_name"] = self._await_job_pod(workload.obj, deadline,
                                                           request.timeout_s)
                case Backend.JOB:
                    # Pending is fine for a Job (the seed's resume check says so), but a
                    # pod the API server refuses is not. The pod it made is recorded: a
                    # resume check that finds another one knows the command started again.
                    info["pod_name"] = self._check_job_start(workload.obj, deadline,
                                                             request.name)
        except Exception as exc:
            self._cleanup_failed_acquire(request.lease_id, LeaseHandle(request.name,
                                                                       backend.value, info), exc)
            raise
        return Acquired(workload.outcome, backend.value, info)

    def _check_job_start(self, job: Obj, deadline: float, name: str) -> str | None:
        """Wait briefly (``job_pod_wait_s``, within the acquire's deadline; 0: not checked)
        for the Job controller's word on the Job's pod (job_start.py); raise if the API
        server refused it. The name of the pod it made, if it said so."""
        if self.job_pod_wait_s <= 0:
            return None  # LEASEKEEPER_KUBE_JOB_POD_WAIT_S=0
        verdict = job_start(self.api, job, min(self.job_pod_wait_s,
                                               max(deadline - self._clock(), 0.0)), self._clock)
        if verdict.outcome is JobStart.REFUSED:
            raise verdict.error(name)
        return verdict.pod

    def _meta(self, backend: Backend, workload: Obj, pod_name: str | None) -> Meta:
        return {
            "namespace": self.api.namespace,
            "pod_name": pod_name,
            "secret_name": secret_name(name_of(workload)),
            "secret_uid": None,  # set once the Secret exists
            "uid": uid_of(workload),
            "backend": backend.value,
            "api_version": workload_api_version(backend, self.defaults),
        }

    def _create_or_adopt(self, backend: Backend, identity: LeaseIdentity,
                         request: AcquireRequest, deadline: float) -> _Workload:
        match backend:
            case Backend.SANDBOX_CR:
                manifest = build_sandbox(identity, request.spec, self.defaults, self._now())
            case Backend.JOB:
                manifest = build_job(identity, request.spec, self.defaults)
        where = f"{backend.value} {self.api.namespace}/{identity.name}"
        # A 409 then a 404: the one holding the name went in between (the garbage collector
        # finishing the Foreground delete of an earlier attempt's). The name is free: create
        # again, a few times within the acquire's deadline; then a retry's matter.
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                return _Workload(self.api.create_workload(backend, manifest),
                                 AcquireOutcome.CREATED)
            except KubeAlreadyExists:
                pass
            except ProviderError as exc:
                # The first request, refused as not permitted (403) or with nothing to make
                # it in (404: no such namespace, or no such API): nothing was made, so the
                # acquire's cleanup has nothing to do (it could not list or delete either).
                if attempt == 0 and exc.status in (403, 404):
                    exc.created_nothing()
                raise
            try:
                existing = self.api.get_workload(backend, identity.name)
            except KubeNotFound:
                if self._clock() >= deadline:
                    break
                continue
            return self._adopt(existing, where, identity)
        raise TransientProviderError(
            f"kubernetes: {where} kept existing when created and being gone when read (an "
            "earlier one under its name is being deleted); retry once it is gone")

    def _adopt(self, existing: Obj, where: str, identity: LeaseIdentity) -> _Workload:
        """The workload a 409 revealed, if it is this lease's (acquire's test: belongs_to,
        and no other controller); refused otherwise, naming why."""
        if controlled_by_other(existing, identity.name):
            raise ProviderConflict(
                f"kubernetes: {where} already exists and {controller_said(existing)}, so it is "
                f"not lease {identity.lease_id}'s, whatever its labels say; refusing to adopt "
                "it: remove it through its controller if it is a leftover, or use another "
                "LEASEKEEPER_KUBE_NAMESPACE")
        if not belongs_to(existing, identity.lease_id, self.installation):
            labels = labels_of(existing)
            raise ProviderConflict(
                f"kubernetes: {where} already exists and is not lease {identity.lease_id}'s "
                f"(installation={labels.get(LABEL_INSTALLATION)!r}, "
                f"lease-id={labels.get(LABEL_LEASE_ID)!r}); refusing to adopt it: delete it "
                "or use another LEASEKEEPER_KUBE_NAMESPACE")
        if is_terminating(existing):
            raise TransientProviderError(
                f"kubernetes: {where} from an earlier attempt is being deleted; retry once "
                "it is gone")
        return _Workload(existing, AcquireOutcome.ADOPTED)

    def _ensure_secret(self, backend: Backend, identity: LeaseIdentity,
                       request: AcquireRequest, workload: Obj) -> str | None:
        """The uid of the lease's Secret: created, adopted (ours), or replaced (ours, but
        owned by an earlier incarnation of the workload)."""
        uid = uid_of(workload)
        if uid is None:
            raise TerminalProviderError(
                f"kubernetes: the API server returned {identity.name} without a uid")
        owner = OwnerRef(workload_api_version(backend, self.defaults), workload_kind(backend),
                         identity.name, uid)
        manifest = build_secret(identity, request.spec, self.defaults, backend, self._token(),
                                owner)
        name = secret_name(identity.name)
        try:
            return uid_of(self.api.create_secret(manifest))
        except KubeAlreadyExists:
            existing = self.api.get_secret_metadata(name)
        where = f"Secret {self.api.namespace}/{name}"
        if controlled_by_other(existing, identity.name):
            # Whatever its labels say: another operator's (an ExternalSecret's, a
            # SealedSecret's...) would make it again, or lose what it holds.
            raise _NotOurs(
                f"kubernetes: {where} exists and {controller_said(existing)}, not by "
                f"{workload_kind(backend)} {identity.name}; refusing to adopt, replace or "
                "delete it: remove it through its controller if it is a leftover, or use "
                "another LEASEKEEPER_KUBE_NAMESPACE")
        if not belongs_to(existing, identity.lease_id, self.installation):
            raise _NotOurs(
                f"kubernetes: {where} exists and is not lease {identity.lease_id}'s; "
                "refusing to adopt it: delete it or use another LEASEKEEPER_KUBE_NAMESPACE")
        if uid in owner_uids(existing) and not is_terminating(existing):
            return uid_of(existing)
        # Ours, but owned by an earlier incarnation of the workload: the garbage collector
        # will remove it under the new pod. Replace it now (that one, by its uid).
        with contextlib.suppress(KubeNotFound):
            self.api.delete_secret(name, uid_of(existing))
        return uid_of(self.api.create_secret(manifest))

    def _await_sandbox(self, sandbox: Obj, deadline: float, timeout_s: float) -> str:
        name = name_of(sandbox)
        result = self._wait_sandbox_settled(self.api, sandbox, deadline)
        match result.outcome:
            case WaitOutcome.DELETED:
                raise TransientProviderError(
                    f"kubernetes: Sandbox {name} was deleted while waiting for it to be Ready")
            case WaitOutcome.REPLACED:
                # a retry adopts it if it is this lease's, and refuses it otherwise
                raise TransientProviderError(
                    f"kubernetes: Sandbox {name} was deleted while waiting for it to be Ready, "
                    "and another Sandbox now holds its name; it is not taken for this one")
            case WaitOutcome.TIMED_OUT:
                state = sandbox_state(result.obj or sandbox)
                raise TransientProviderError(
                    f"kubernetes: Sandbox {name} did not become Ready within {timeout_s:g}s "
                    f"({state.reason}); is the agent-sandbox controller running and can the "
                    "pod be scheduled?")
            case WaitOutcome.SETTLED:
                settled = result.obj or sandbox
        state = sandbox_state(settled)
        if state.refused_pod:
            raise pod_refused(f"the agent-sandbox controller could not create the pod of "
                              f"Sandbox {name}", state.refused_pod,
                              "the Sandbox and its Secret were removed")
        match state.phase:
            case SandboxPhase.FAILED:
                raise TerminalProviderError(f"kubernetes: {state.reason}")
            case SandboxPhase.TERMINATING | SandboxPhase.PENDING:
                raise TransientProviderError(f"kubernetes: {state.reason or 'not Ready'}")
            case SandboxPhase.READY:
                pass
        # Ready means the controller saw its pod Ready just now: name it from the Sandbox
        # (agent-sandbox names the pod after the Sandbox, or in the pod-name annotation)
        # instead of reading it. That read cost a request and, with the watch's connection
        # just closed, a TLS handshake: ~60% of the Ready-to-acquired latency. resume_check
        # still looks the pod up (and up to the label, never by prefix) before any use.
        return sandbox_pod_hint(settled) or name

    def _wait_sandbox_settled(self, api: KubeApi, sandbox: Obj, deadline: float) -> WaitResult:
        """Until the Sandbox is Ready, Failed or Terminating (or gone, or the deadline)."""
        name = name_of(sandbox)

        def reread() -> Obj | None:
            try:
                return api.get_workload(Backend.SANDBOX_CR, name)
            except KubeNotFound:
                return None

        return wait_for(
            initial=sandbox,
            watch=lambda rv, timeout: api.watch_sandbox(name, rv, timeout),
            reread=reread,
            settled=lambda obj: sandbox_state(obj).phase is not SandboxPhase.PENDING,
            deadline=deadline, clock=self._clock, incarnation=uid_of(sandbox))

    def _await_job_pod(self, job: Obj, deadline: float, timeout_s: float) -> str:
        """The name of the Job's pod once it is Running: one list, then one watch of the
        pods its controller labels with the Job's uid, under the acquire's deadline."""
        name, uid = name_of(job), uid_of(job)
        selector = f"{JOB_UID_LABEL}={uid}"

        def current() -> Obj:
            # The pod if there is one yet, else a stand-in carrying the list's
            # resourceVersion, so the watch starts where the list ended.
            listed = self.api.list_pods_versioned(selector)
            chosen = pick_pod(listed.items, uid)
            return chosen or {"metadata": {"resourceVersion": listed.resource_version}}

        result = wait_for(
            initial=current(),
            watch=lambda rv, timeout: self.api.watch_pods(selector, rv, timeout),
            reread=current,
            settled=lambda pod: controlled_by(pod, uid) and _pod_started_or_ended(pod),
            deadline=deadline, clock=self._clock)
        match result.outcome:
            case WaitOutcome.DELETED | WaitOutcome.REPLACED:  # REPLACED: not for a list
                raise TransientProviderError(
                    f"kubernetes: the pod of Job {name} was deleted before it ran")
            case WaitOutcome.TIMED_OUT:
                raise TransientProviderError(
                    f"kubernetes: the pod of Job {name} was not Running within {timeout_s:g}s; "
                    "can it be scheduled, and its image pulled?")
            case WaitOutcome.SETTLED:
                pod = result.obj or {}
        problem = pod_not_running_reason(pod)
        if problem is None:
            return name_of(pod)
        if is_terminating(pod):
            raise TransientProviderError(f"kubernetes: Job {name}: {problem}")
        raise TerminalProviderError(
            f"kubernetes: Job {name} cannot be a pool member: {problem} before it could be "
            "claimed (a pool's template command must keep running until a run comes)")

    def _cleanup_failed_acquire(self, lease_id: str, handle: LeaseHandle,
                                cause: Exception) -> None:
        try:
            self.destroy(handle)
        except ProviderError as cleanup:
            raise AcquireCleanupIncomplete.of(lease_id, cause, cleanup) from cause

    # -- pods -----------------------------------------------------------------------------
    def _sandbox_pod(self, sandbox: Obj, api: KubeApi | None = None) -> _PodLookup:
        """status.podName / the pod-name annotation; with neither, the pod named like the
        Sandbox, then label agents.x-k8s.io/sandbox-name preferring Running. Never by
        prefix, and only a pod the Sandbox controls (its controller ownerReference is the
        Sandbox's uid): a pod that merely carries the name or the label is someone else's.
        A Sandbox that names a pod not its own is inconsistent: no pod (that one is not
        used, and neither is any other in its place)."""
        api = api or self.api
        name, uid = name_of(sandbox), uid_of(sandbox)
        hint = sandbox_pod_hint(sandbox)
        if hint:
            try:
                pod = api.get_pod(hint)
            except KubeNotFound:
                return _PodLookup(None, f"Pod {hint} no longer exists")
            if controlled_by(pod, uid):
                return _PodLookup(pod)
            return _PodLookup(None, f"Pod {hint}, which Sandbox {name} names, is not its "
                                    f"({controller_said(pod)}): the Sandbox is inconsistent "
                                    "and no pod of it is used; see what set its status.podName "
                                    "or pod-name annotation, then recreate the sandbox")
        try:
            pod = api.get_pod(name)
            if controlled_by(pod, uid):
                return _PodLookup(pod)
        except KubeNotFound:
            pass
        return _PodLookup(pick_pod(api.list_pods(f"{SANDBOX_NAME_LABEL}={name}"), uid))

    def _job_pod(self, job: Obj, api: KubeApi | None = None) -> Obj | None:
        api = api or self.api
        return pick_pod(api.list_pods(f"{JOB_NAME_LABEL}={name_of(job)}"), uid_of(job))

    # -- resume check ---------------------------------------------------------------------
    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        backend = self._backend(handle.backend or handle.meta.get("backend"))
        api = self._api_for(handle.meta)
        recorded = handle.meta.get("uid")
        match backend:
            case Backend.SANDBOX_CR:
                return self._resume_sandbox(api, handle.name, recorded, timeout_s)
            case Backend.JOB:
                return self._resume_job(api, handle.name, recorded,
                                        handle.meta.get("pod_name"))

    def _resume_sandbox(self, api: KubeApi, name: str, recorded: object,
                        timeout_s: float) -> ResumeResult:
        deadline = self._clock() + timeout_s
        gone = ResumeResult.not_resumable("Sandbox CR no longer exists")
        try:
            sandbox = api.get_workload(Backend.SANDBOX_CR, name)
        except KubeNotFound:
            return gone
        if not self._is_the_leases(sandbox, name, recorded):
            return ResumeResult.not_resumable(self._not_the_leases(Backend.SANDBOX_CR, name))
        state = sandbox_state(sandbox)
        if state.phase is SandboxPhase.PENDING:
            result = self._wait_sandbox_settled(api, sandbox, deadline)
            match result.outcome:
                case WaitOutcome.DELETED:
                    return gone
                case WaitOutcome.TIMED_OUT:
                    last = sandbox_state(result.obj or sandbox)
                    return ResumeResult.not_resumable(
                        f"Sandbox {name} did not become Ready within {timeout_s:g}s "
                        f"({last.reason})")
                case WaitOutcome.SETTLED | WaitOutcome.REPLACED:
                    sandbox = result.obj or sandbox
                    state = sandbox_state(sandbox)
            if not self._is_the_leases(sandbox, name, recorded):  # replaced while waiting
                return ResumeResult.not_resumable(
                    self._not_the_leases(Backend.SANDBOX_CR, name))
        match state.phase:
            case SandboxPhase.FAILED | SandboxPhase.TERMINATING | SandboxPhase.PENDING:
                return ResumeResult.not_resumable(state.reason)
            case SandboxPhase.READY:
                pass
        lookup = self._sandbox_pod(sandbox, api)
        if lookup.pod is None:
            return ResumeResult.not_resumable(lookup.reason)
        problem = pod_not_running_reason(lookup.pod)
        if problem:
            return ResumeResult.not_resumable(problem)
        return ResumeResult.resumable(pod_name=name_of(lookup.pod), phase="Running",
                                      namespace=api.namespace)

    def _resume_job(self, api: KubeApi, name: str, recorded: object,
                    pod_name: object) -> ResumeResult:
        try:
            job = api.get_workload(Backend.JOB, name)
        except KubeNotFound:
            return ResumeResult.not_resumable("Job no longer exists")
        if not self._is_the_leases(job, name, recorded):
            return ResumeResult.not_resumable(self._not_the_leases(Backend.JOB, name))
        if is_terminating(job):
            return ResumeResult.not_resumable(f"Job {name} is terminating")
        phase = job_phase(job)
        match phase:
            case JobPhase.SUCCEEDED | JobPhase.FAILED:
                # how it ended, as list_managed tells sweep.finish_exited (one more read,
                # only for a finished Job), so the check records its runs the same way
                stopped = job_stop_reason(job)
                code = (None if stopped is not None else
                        job_exit_code(job, api.list_pods(f"{JOB_NAME_LABEL}={name}")))
                return ResumeResult.not_resumable(f"Job is {phase.value}", exit_code=code,
                                                  exit_reason=stopped)
            case JobPhase.GONE:
                return ResumeResult.not_resumable("Job no longer exists")
            case JobPhase.PENDING | JobPhase.RUNNING:
                pod = self._job_pod(job, api)
                if pod is None:  # none yet, or refused: the controller's Events say which
                    verdict = job_start(api, job, 0, self._clock)
                    if verdict.outcome is JobStart.REFUSED:
                        return ResumeResult.not_resumable(
                            f"the pod of Job {name} was refused: {verdict.message[:300]}")
                    return ResumeResult.resumable(pod_name=None, phase="Pending",
                                                  namespace=api.namespace)
                return self._resume_job_pod(api, name, pod, pod_name, phase)

    def _resume_job_pod(self, api: KubeApi, name: str, pod: Obj, recorded_pod: object,
                        phase: JobPhase) -> ResumeResult:
        """The Job's pod, in the words ``_resume_sandbox`` uses for a Sandbox's
        (``pod_not_running_reason``); but Pending is fine for a Job (it may still be
        scheduled or pulling), unless it can never start (``pod_cannot_start``: a missing
        Secret, the lease's own checked by one more read; an image no retry pulls). A pod
        that ended or is going while the Job is still active is reported as before: the
        Job's own phase (which ``phase`` reports, as the seed does) follows within moments.
        A pod other than the one acquire recorded means the Job controller replaced it:
        the command started again; the details say so (``restarted``)."""
        cannot = pod_cannot_start(pod)
        if cannot is not None and not self._secret_there(api, name, pod):
            return ResumeResult.not_resumable(f"{cannot}: it cannot start")
        details: dict[str, object] = {}
        if recorded_pod and recorded_pod != name_of(pod):
            details = {"restarted": True, "recorded_pod_name": recorded_pod}
        return ResumeResult.resumable(
            pod_name=name_of(pod), phase=phase.value, namespace=api.namespace, **details)

    @staticmethod
    def _secret_there(api: KubeApi, name: str, pod: Obj) -> bool:
        """For a pod waiting on CreateContainerConfigError: whether the lease's Secret
        exists now (the kubelet then starts the container on its next try: a pod made
        before acquire created the Secret waits so for a moment). False for any other
        reason it cannot start."""
        waiting = container_waiting(pod)
        if waiting is None or waiting[0] != "CreateContainerConfigError":
            return False
        try:
            api.get_secret_metadata(secret_name(name))
        except KubeNotFound:
            return False
        return True

    # -- claim (warm pools) ----------------------------------------------------------------
    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        """A run takes this pool member: check cheaply that it can be used (workload and pod
        read; not claimable is NOT_RESUMABLE with the reason), then deliver the run's data
        by one exec into its sandbox container, on stdin (delivery.py). Idempotent: a
        repeated claim writes the same files again. The exec's failures raise (transient or
        terminal, from the client's boundary) unless they show the pod went away."""
        deadline = self._clock() + request.timeout_s
        backend = self._backend(handle.backend or handle.meta.get("backend"))
        api = self._api_for(handle.meta)
        pod_name, recorded = handle.meta.get("pod_name"), handle.meta.get("uid")
        match backend:
            case Backend.SANDBOX_CR:
                found = self._claimable_sandbox(api, handle.name, recorded, pod_name)
            case Backend.JOB:
                found = self._claimable_job(api, handle.name, recorded, pod_name)
        if isinstance(found, Claimed):
            return found
        delivery = build_delivery(request)
        try:
            api.exec_with_stdin(found.pod, CONTAINER_NAME, delivery.command, delivery.stdin,
                                max(deadline - self._clock(), 0.0), exits=DELIVERY_EXITS,
                                failed_hint=DELIVERY_FAILED_HINT, secrets=delivery.secrets,
                                clock=self._clock)
        except (KubeCommandFailed, KubeCommandInterrupted):
            raise  # the command ran: the pod was there
        except ProviderError as exc:
            if exc.status not in (None, 400, 404, 500):
                raise  # 401, 403, 429...: not about the pod
            gone = self._pod_gone_reason(api, found.pod)
            if gone is None:
                raise
            return _not_claimable(gone)
        return Claimed(ClaimOutcome.CLAIMED, meta={
            "pod_name": found.pod, "claimed_at": self._now().isoformat()})

    def _claimable_sandbox(self, api: KubeApi, name: str, recorded: object,
                           pod_name: object) -> _Claimable | Claimed:
        try:
            sandbox = api.get_workload(Backend.SANDBOX_CR, name)
        except KubeNotFound:
            return _not_claimable("Sandbox CR no longer exists")
        if not self._is_the_leases(sandbox, name, recorded):
            return _not_claimable(self._not_the_leases(Backend.SANDBOX_CR, name))
        state = sandbox_state(sandbox)
        match state.phase:
            case SandboxPhase.PENDING:
                return _not_claimable(f"Sandbox {name} is not Ready ({state.reason})")
            case SandboxPhase.FAILED | SandboxPhase.TERMINATING:
                return _not_claimable(state.reason)
            case SandboxPhase.READY:
                pass
        hint = sandbox_pod_hint(sandbox)
        if pod_name and hint in (None, pod_name):
            return self._claimable_pod(api, str(pod_name), uid_of(sandbox), f"Sandbox {name}")
        # none recorded, or the Sandbox names another pod now: the Sandbox's word decides
        lookup = self._sandbox_pod(sandbox, api)
        if lookup.pod is None:
            return _not_claimable(lookup.reason)
        return self._running(lookup.pod)

    def _claimable_job(self, api: KubeApi, name: str, recorded: object,
                       pod_name: object) -> _Claimable | Claimed:
        try:
            job = api.get_workload(Backend.JOB, name)
        except KubeNotFound:
            return _not_claimable("Job no longer exists")
        if not self._is_the_leases(job, name, recorded):
            return _not_claimable(self._not_the_leases(Backend.JOB, name))
        if is_terminating(job):
            return _not_claimable(f"Job {name} is terminating")
        phase = job_phase(job)
        match phase:
            case JobPhase.SUCCEEDED | JobPhase.FAILED:
                return _not_claimable(f"Job is {phase.value}")
            case JobPhase.GONE:
                return _not_claimable("Job no longer exists")
            case JobPhase.PENDING | JobPhase.RUNNING:
                pass
        if pod_name:
            return self._claimable_pod(api, str(pod_name), uid_of(job), f"Job {name}")
        pod = self._job_pod(job, api)
        if pod is None:
            return _not_claimable(f"Job {name} has no pod")
        return self._running(pod)

    def _claimable_pod(self, api: KubeApi, pod_name: str, owner_uid: str | None,
                       owner: str) -> _Claimable | Claimed:
        try:
            pod = api.get_pod(pod_name)
        except KubeNotFound:
            return _not_claimable(f"Pod {pod_name} no longer exists")
        if not controlled_by(pod, owner_uid):
            return _not_claimable(f"Pod {pod_name} is no longer {owner}'s")
        return self._running(pod)

    @staticmethod
    def _running(pod: Obj) -> _Claimable | Claimed:
        problem = pod_not_running_reason(pod)
        return _not_claimable(problem) if problem else _Claimable(name_of(pod))

    @staticmethod
    def _pod_gone_reason(api: KubeApi, pod_name: str) -> str | None:
        """Why the pod can no longer be claimed (gone, not Running), or None if it still
        runs (or cannot be read: then the exec's own error is what to report)."""
        try:
            pod = api.get_pod(pod_name)
        except KubeNotFound:
            return f"Pod {pod_name} no longer exists"
        except ProviderError:
            return None
        return pod_not_running_reason(pod)

    def job_exit(self, handle: LeaseHandle) -> JobExit:
        """A Job's phase and, once terminal, its container's exit code (None if unknown)."""
        api = self._api_for(handle.meta)
        try:
            job = api.get_workload(Backend.JOB, handle.name)
        except KubeNotFound:
            return JobExit(JobPhase.GONE, None)
        if not self._is_the_leases(job, handle.name, handle.meta.get("uid")):
            return JobExit(JobPhase.GONE, None)
        phase = job_phase(job)
        match phase:
            case JobPhase.PENDING | JobPhase.RUNNING | JobPhase.GONE:
                return JobExit(phase, None)
            case JobPhase.SUCCEEDED | JobPhase.FAILED:
                pods = api.list_pods(f"{JOB_NAME_LABEL}={handle.name}")
                return JobExit(phase, job_exit_code(job, pods))

    # -- destroy --------------------------------------------------------------------------
    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        """Workload, its pods, its Secret: each part attempted, each failure reported. No
        part is deleted on a name alone: by the uid recorded at acquire (a server-side
        precondition), else only if ``_ours`` says it is this lease's (acquire's test, for
        the lease whose name is ``handle.name``), and then by the uid just read. Anyone
        else's object, never: no DELETE is sent for it."""
        raw = handle.backend or handle.meta.get("backend")
        backend = self._backend_or_none(str(raw)) if raw else self.default_backend
        if backend is None:
            # acquire refuses such a backend before it creates anything (_backend), and
            # every object this code makes is of a backend it has: nothing to delete.
            log.warning("kubernetes: destroy of %s: backend %s is none this provider has, so "
                        "nothing of it was ever created; already gone", handle.name,
                        echo(str(raw)))
            return DestroyOutcome.ALREADY_GONE
        api = self._api_for(handle.meta)
        name = handle.name
        failures: list[PartFailure] = []
        deleted = 0
        # What to delete besides the workload is settled first, while the workload still
        # holds its dependents: the garbage collector, quick to start on them once it goes,
        # cannot turn a delete into a read that finds nothing (and a 404 is done anyway).
        # The pods are deleted explicitly, as the seed does: a Job (or Sandbox) in Foreground
        # deletion keeps its pods running for as long as the GC is slow or stuck. One made
        # after the list is left to the GC, and to sweep.orphans if that is stuck.
        try:
            pods = api.list_pods(self._parts_selector(name))
        except ProviderError as exc:
            failures.append(PartFailure("pod", exc))
            pods = []
        # A recorded secret_name of None means "the Secret under that name is not ours".
        secret = handle.meta["secret_name"] if "secret_name" in handle.meta else secret_name(name)
        target: _SecretTarget | None = None
        if secret:
            try:
                target = self._secret_target(api, str(secret), name,
                                             handle.meta.get("secret_uid"))
            except ProviderError as exc:
                failures.append(PartFailure("secret", exc))
        try:
            deleted += self._destroy_workload(api, backend, name, handle.meta.get("uid"))
        except ProviderError as exc:
            failures.append(PartFailure("workload", exc))
        for pod in pods:
            try:
                deleted += self._destroy_pod(api, pod, name)
            except ProviderError as exc:
                failures.append(PartFailure("pod", exc))
        if target is not None:
            try:
                deleted += self._destroy_secret(api, name, target)
            except ProviderError as exc:
                failures.append(PartFailure("secret", exc))
        if failures:
            raise DestroyIncomplete.of(name, failures)
        return DestroyOutcome.DESTROYED if deleted else DestroyOutcome.ALREADY_GONE

    def _parts_selector(self, name: str) -> str:
        return f"{installation_selector(self.installation)},{LABEL_WORKLOAD}={name}"

    def _destroy_workload(self, api: KubeApi, backend: Backend, name: str,
                          uid: object) -> int:
        """1 if a workload was deleted. With the recorded uid the server checks it is that
        incarnation; when it is not (409), or nothing was recorded, the one there now is
        deleted only if it is ours: a later incarnation of this lease (an acquire that raced
        a sweep's destroy, a create whose answer was lost and landed late) goes too."""
        if uid:
            try:
                api.delete_workload(backend, name, str(uid))
                return 1
            except KubeNotFound:
                return 0
            except ProviderConflict:
                pass  # the uid precondition failed: the name holds another incarnation
        try:
            current = api.get_workload(backend, name)
            return self._delete_verified(
                current, name, lambda w: api.delete_workload(backend, name, uid_of(w)))
        except KubeNotFound:
            return 0

    def _destroy_pod(self, api: KubeApi, pod: Obj, name: str) -> int:
        """1 if the listed pod, or the one holding its name now, was deleted. A 409 says the
        name holds another incarnation (its controller made it again since the list: the
        workload was not gone yet): that one goes too if it is ours."""
        def delete(found: Obj) -> object:
            return api.delete_pod(name_of(found), uid_of(found))

        try:
            return self._delete_verified(pod, name, delete)
        except ProviderConflict:
            pass
        try:
            return self._delete_verified(api.get_pod(name_of(pod)), name, delete)
        except KubeNotFound:
            return 0

    def _secret_target(self, api: KubeApi, secret: str, name: str,
                       uid: object) -> _SecretTarget | None:
        """The Secret to delete: by the uid acquire recorded (no request), else the one
        there now if its labels say it is ours (None if it is not, or is gone)."""
        if uid:
            return _SecretTarget(secret, str(uid), recorded=True)
        try:
            current = api.get_secret_metadata(secret)
        except KubeNotFound:
            return None
        found = uid_of(current)
        if not self._ours(current, name) or found is None:
            return None
        return _SecretTarget(secret, found, recorded=False)

    def _destroy_secret(self, api: KubeApi, name: str, target: _SecretTarget) -> int:
        """1 if the Secret was deleted. If the recorded one was replaced since (409), the
        one there now is deleted only if it is ours."""
        try:
            api.delete_secret(target.name, target.uid)
            return 1
        except KubeNotFound:
            return 0
        except ProviderConflict:
            if not target.recorded:
                raise
        try:
            current = api.get_secret_metadata(target.name)
            return self._delete_verified(
                current, name, lambda s: api.delete_secret(target.name, uid_of(s)))
        except KubeNotFound:
            return 0

    def _delete_verified(self, obj: Obj, name: str, delete: Callable[[Obj], object]) -> int:
        """Delete ``obj`` (by its own uid) if its labels say it is ours; 1 if deleted."""
        if not self._ours(obj, name) or uid_of(obj) is None:
            return 0
        try:
            delete(obj)
        except KubeNotFound:
            return 0
        return 1

    def _ours(self, obj: Obj, name: str) -> bool:
        """This lease's part of workload ``name``, by the test acquire adopts by
        (``belongs_to``: this installation's labels and the lease's id, label and exact
        annotation), labelled as part of that workload, and controlled by nothing but it.
        No lease id comes with a handle: names are derived from lease ids, so the lease is
        the one the object names (its exact annotation, else its label), and only if that
        lease's name is ``name``: a Secret under our name labelled with another lease's id
        (made by hand, or by another tool) is not ours. Labels can be copied (a
        Deployment's pod template): an object another controller owns is never ours."""
        labels = labels_of(obj)
        exact = (meta(obj).get("annotations") or {}).get(ANNOTATION_LEASE_ID)
        lease_id = str(exact or labels.get(LABEL_LEASE_ID) or "")
        return (bool(lease_id) and _lease_name(lease_id) == name
                and belongs_to(obj, lease_id, self.installation)
                and labels.get(LABEL_WORKLOAD) == name
                and not controlled_by_other(obj, name))

    def _is_the_leases(self, workload: Obj, name: str, recorded: object) -> bool:
        """The lease's own workload: the incarnation acquire recorded (its uid), or one
        that ``_ours`` says is this lease's. Anything else holding the name (another
        installation's, a user's, made after ours was deleted) is not: it counts as gone,
        and never gets a run's data."""
        if recorded and uid_of(workload) == str(recorded):
            return True
        return self._ours(workload, name)

    @staticmethod
    def _not_the_leases(backend: Backend, name: str) -> str:
        kind = workload_kind(backend)
        return (f"{kind} {name} no longer exists: the {kind} now under its name is not this "
                "lease's (another installation's or a user's); it is left alone")

    # -- enumerate ------------------------------------------------------------------------
    def list_managed(self) -> list[ManagedResource]:
        """Four lists by the installation label (Sandboxes, Jobs, Secret metadata, pods),
        one entry per workload; Secrets and pods whose workload is gone are reported as
        orphans; an object another controller owns is left out, whatever its labels (one
        labelled for another lease is listed: destroy refuses it). A
        finished Job's entry carries its container's exit code, read from the
        pods already listed (no request per Job), or, for a Job Kubernetes stopped before
        its command exited (its active deadline), no code and that reason. A workload
        terminating for ``terminating_limit_s`` or more is marked ``stuck_terminating``."""
        now = self._now()
        selector = installation_selector(self.installation)
        workloads: list[tuple[Backend, Obj]] = []
        for backend in Backend:
            try:
                workloads += [(backend, obj)
                              for obj in self.api.list_workloads(backend, selector)]
            except KubeNotFound:  # the Sandbox CRD is not installed: nothing of that kind
                continue
        secrets = self.api.list_secret_metadata(selector)
        pods = self.api.list_pods(selector)
        # Labels can be copied (a Deployment's pod template, a CronJob's Job): an object
        # another controller owns is not ours, neither a workload nor an orphan to sweep.
        # One labelled for another lease stays listed (sweep.stuck_provisioning leaves a
        # lease whose name it holds for an operator); destroy refuses it all the same.
        workloads = [(b, obj) for b, obj in workloads
                     if not controlled_by_other(obj, name_of(obj))]
        secrets = [obj for obj in secrets if not self._controlled_elsewhere(obj)]
        pods = [obj for obj in pods if not self._controlled_elsewhere(obj)]
        pods_of: dict[str, list[Obj]] = {}
        for listed in pods:
            pods_of.setdefault(labels_of(listed).get(LABEL_WORKLOAD, ""), []).append(listed)
        found: dict[str, ManagedResource] = {}
        for backend, obj in workloads:
            name = name_of(obj)
            own_pods = pods_of.get(name, [])
            info: Meta = {
                "namespace": self.api.namespace,
                "uid": uid_of(obj),
                "backend": backend.value,
                "api_version": obj.get("apiVersion"),
                "secret_name": secret_name(name),
                "terminating": is_terminating(obj),
            }
            since = terminating_since(obj)
            if since is not None:
                info["terminating_since"] = since.isoformat()
                info["stuck_terminating"] = (now - since).total_seconds() >= \
                    self.terminating_limit_s
            chosen = pick_pod(own_pods, uid_of(obj))
            if chosen is not None:
                info["pod_name"] = name_of(chosen)
            pool = labels_of(obj).get(LABEL_POOL)
            if pool:
                info["pool"] = pool
            stopped = job_stop_reason(obj) if backend is Backend.JOB else None
            exit_code = (job_exit_code(obj, own_pods)
                         if backend is Backend.JOB and stopped is None else None)
            found[name] = self._managed(obj, backend, info, exit_code=exit_code,
                                        exit_reason=stopped)
        leftovers = [("secret_name", obj) for obj in secrets]
        leftovers += [("pod_name", obj) for obj in pods]
        for key, obj in leftovers:
            workload = labels_of(obj).get(LABEL_WORKLOAD)
            if not workload or workload in found:
                continue
            kind = self._backend_or_none(labels_of(obj).get(LABEL_BACKEND))
            if kind is None:
                continue
            found[workload] = self._managed(obj, kind, {
                "namespace": self.api.namespace, "backend": kind.value, "orphaned": True,
                key: name_of(obj)}, name=workload)
        return sorted(found.values(), key=lambda r: r.name)

    @staticmethod
    def _controlled_elsewhere(part: Obj) -> bool:
        """A Secret or pod controlled by something other than the workload it names."""
        return controlled_by_other(part, labels_of(part).get(LABEL_WORKLOAD, ""))

    def _backend_or_none(self, raw: str | None) -> Backend | None:
        try:
            return Backend(raw) if raw else None
        except ValueError:
            return None

    @staticmethod
    def _managed(obj: Obj, backend: Backend, info: Meta, name: str | None = None,
                 exit_code: int | None = None,
                 exit_reason: str | None = None) -> ManagedResource:
        exact = (meta(obj).get("annotations") or {}).get(ANNOTATION_LEASE_ID)
        return ManagedResource(
            name=name or name_of(obj), backend=backend.value,
            lease_id=exact or labels_of(obj).get(LABEL_LEASE_ID),
            created_at=created_at(obj), meta=info, exit_code=exit_code,
            exit_reason=exit_reason)


def build_kubernetes_provider(settings: Settings) -> KubernetesProvider:
    """The provider for these settings (loads the kubeconfig or in-cluster config now)."""
    api = KubeApi(build_api_client(settings), settings.kube_namespace,
                  settings.kube_request_timeout_s, settings.kube_sandbox_api_version)
    return KubernetesProvider(api, WorkloadDefaults.from_settings(settings),
                              settings.installation_id, Backend(settings.kube_backend),
                              terminating_limit_s=settings.kube_terminating_limit_s,
                              job_pod_wait_s=settings.kube_job_pod_wait_s)
