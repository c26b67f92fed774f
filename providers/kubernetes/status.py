"""Pure readings of API objects (plain JSON dicts as the API server returns them): is a
Sandbox Ready / Failed / Terminating, what phase a Job is in, which pod backs a workload,
what a pod's state means for a resume, whether an object belongs to this lease.

No I/O here; provider.py fetches, these functions decide. ``exec_status`` reads what an
exec's status channel said.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from providers.kubernetes.manifests import (
    ANNOTATION_LEASE_ID,
    CONTAINER_NAME,
    LABEL_INSTALLATION,
    LABEL_LEASE_ID,
    SANDBOX_GROUP,
    SANDBOX_KIND,
    SANDBOX_POD_ANNOTATION,
    label_value,
)

Obj = Mapping[str, Any]
PodT = TypeVar("PodT", bound=Mapping[str, Any])

# Ready=False with one of these reasons never turns Ready again: fail fast, like a
# Failed condition (agent-sandbox's own client keeps such a set for claims).
TERMINAL_READY_REASONS: frozenset[str] = frozenset({"SandboxExpired"})
_FAILED_REASON = re.compile("failed", re.IGNORECASE)
# The controller could not create the sandbox's pod because the API server refused it as
# invalid (422: `Pod "x" is invalid: ...`) or forbidden by admission (403: `pods "x" is
# forbidden: ...`: a LimitRange, a used-up ResourceQuota, PodSecurity): the same pod is
# refused on every try (a quota frees up, but not while the controller retries it).
_REFUSED_POD = re.compile(r'\bis (?:invalid|forbidden): ')
# A container waiting for one of these cannot start until someone changes something: a
# missing Secret / ConfigMap (CreateContainerConfigError), an image name that cannot be
# pulled by any retry.
CANNOT_START_REASONS: frozenset[str] = frozenset({
    "CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull"})
# A Job Failed for one of these reasons was stopped by Kubernetes before its command
# exited: it has ended, and it has no exit code of its own (its pods were killed).
STOPPED_JOB_REASONS: frozenset[str] = frozenset({"DeadlineExceeded"})
# (API group, kind) of the workloads leasekeeper creates: the only controllers its pods and
# Secrets may have.
WORKLOAD_KINDS: frozenset[tuple[str, str]] = frozenset({(SANDBOX_GROUP, SANDBOX_KIND),
                                                         ("batch", "Job")})


class SandboxPhase(StrEnum):
    READY = "ready"
    PENDING = "pending"
    FAILED = "failed"
    TERMINATING = "terminating"


@dataclass(frozen=True)
class SandboxState:
    phase: SandboxPhase
    reason: str = ""
    refused_pod: str = ""  # the API server's message refusing the Sandbox's pod, if it did


class JobPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    GONE = "Gone"  # the Job no longer exists (only job_exit reports it)


class ExecEnd(StrEnum):
    SUCCEEDED = "succeeded"  # Status Success: the command exited 0
    EXITED = "exited"  # NonZeroExitCode with its ExitCode cause
    FAILED = "failed"  # any other Failure: the command did not run or was not seen to end
    MISSING = "missing"  # the stream closed without a (readable) status


@dataclass(frozen=True)
class ExecStatus:
    end: ExecEnd
    exit_code: int | None = None
    status: Mapping[str, Any] | None = None  # the Status object, for FAILED


def exec_status(raw: str) -> ExecStatus:
    """The outcome an exec's status channel (v4 / v5) reports: ``{"status": "Success"}``, or
    ``{"status": "Failure", "reason": "NonZeroExitCode", "details": {"causes": [{"reason":
    "ExitCode", "message": "<n>"}]}}``, or another Failure (the kubelet's own errors)."""
    try:
        status = json.loads(raw) if raw.strip() else None
    except ValueError:
        status = None
    if not isinstance(status, dict) or "status" not in status:
        return ExecStatus(ExecEnd.MISSING)
    if status["status"] == "Success":
        return ExecStatus(ExecEnd.SUCCEEDED, 0)
    if status.get("reason") == "NonZeroExitCode":
        for cause in (status.get("details") or {}).get("causes") or []:
            if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
                with contextlib.suppress(TypeError, ValueError):
                    return ExecStatus(ExecEnd.EXITED, int(str(cause.get("message"))), status)
    return ExecStatus(ExecEnd.FAILED, None, status)


def meta(obj: Obj) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def name_of(obj: Obj) -> str:
    return str(meta(obj).get("name", ""))


def uid_of(obj: Obj) -> str | None:
    uid = meta(obj).get("uid")
    return str(uid) if uid else None


def resource_version(obj: Obj) -> str | None:
    rv = meta(obj).get("resourceVersion")
    return str(rv) if rv else None


def labels_of(obj: Obj) -> Mapping[str, str]:
    return meta(obj).get("labels") or {}


def is_terminating(obj: Obj) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def _timestamp(obj: Obj, key: str) -> datetime | None:
    raw = meta(obj).get(key)
    if not raw:
        return None
    return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))


def created_at(obj: Obj) -> datetime | None:
    return _timestamp(obj, "creationTimestamp")


def terminating_since(obj: Obj) -> datetime | None:
    """When the object's deletion began (its deletionTimestamp), if it has."""
    return _timestamp(obj, "deletionTimestamp")


def _conditions(obj: Obj) -> dict[str, Mapping[str, Any]]:
    status = obj.get("status") or {}
    return {str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, dict)}


def _describe(cond: Mapping[str, Any]) -> str:
    reason = cond.get("reason") or ""
    message = cond.get("message") or ""
    return ": ".join(p for p in (str(reason), str(message)) if p)


def sandbox_state(sandbox: Obj) -> SandboxState:
    """Ready = condition Ready=True (or phase Ready on old controllers). Failed = a Failed
    condition or phase, Ready=False with a reason matching /failed/i, a terminal reason or
    a message saying the API server refused its pod as invalid, or Finished=True (its pod
    ended). Terminating = deletionTimestamp set."""
    name = name_of(sandbox)
    if is_terminating(sandbox):
        return SandboxState(SandboxPhase.TERMINATING, f"Sandbox {name} is terminating")
    conds = _conditions(sandbox)
    phase = str((sandbox.get("status") or {}).get("phase") or "")
    failed = conds.get("Failed")
    if failed is not None and failed.get("status") == "True":
        return SandboxState(SandboxPhase.FAILED, f"Sandbox {name} failed ({_describe(failed)})")
    if phase == "Failed":
        return SandboxState(SandboxPhase.FAILED, f"Sandbox {name} is in phase Failed")
    finished = conds.get("Finished")
    if finished is not None and finished.get("status") == "True":
        return SandboxState(SandboxPhase.FAILED,
                            f"Sandbox {name} finished ({_describe(finished)})")
    ready = conds.get("Ready")
    if ready is not None:
        status, reason = ready.get("status"), str(ready.get("reason") or "")
        if status == "True":
            return SandboxState(SandboxPhase.READY)
        message = str(ready.get("message") or "")
        if status == "False" and _REFUSED_POD.search(message):
            said = status_message(message)
            return SandboxState(SandboxPhase.FAILED,
                                f"Sandbox {name} is not Ready ({reason}: {said})", said)
        if status == "False" and (_FAILED_REASON.search(reason)
                                  or reason in TERMINAL_READY_REASONS):
            return SandboxState(SandboxPhase.FAILED,
                                f"Sandbox {name} is not Ready ({_describe(ready)})")
        return SandboxState(SandboxPhase.PENDING,
                            f"Ready={status} ({_describe(ready) or 'no reason given'})")
    if phase == "Ready":
        return SandboxState(SandboxPhase.READY)
    return SandboxState(SandboxPhase.PENDING,
                        f"phase {phase}" if phase else "no Ready condition yet")


def status_message(text: str) -> str:
    """The ``message`` of a Kubernetes Status a controller quoted as raw JSON in ``text``
    (``creating the pod failed: {"kind":"Status",...,"message":"pods \\"x\\" is
    forbidden: ..."}``), else ``text`` itself, its whitespace collapsed."""
    start = text.find("{")
    if start >= 0:
        with contextlib.suppress(ValueError):
            status, _ = json.JSONDecoder().raw_decode(text[start:])
            if isinstance(status, dict) and status.get("message"):
                return " ".join(str(status["message"]).split())
    return " ".join(text.split())


def job_phase(job: Obj) -> JobPhase:
    """Failed condition or failed>0 → Failed; Complete condition or succeeded>0 →
    Succeeded; active>0 → Running; else Pending."""
    status = job.get("status") or {}
    conds = _conditions(job)

    def true(kind: str) -> bool:
        return (conds.get(kind) or {}).get("status") == "True"

    if true("Failed") or int(status.get("failed") or 0) > 0:
        return JobPhase.FAILED
    if true("Complete") or int(status.get("succeeded") or 0) > 0:
        return JobPhase.SUCCEEDED
    if int(status.get("active") or 0) > 0:
        return JobPhase.RUNNING
    return JobPhase.PENDING


def job_stop_reason(job: Obj) -> str | None:
    """The reason of a Job's Failed=True condition when Kubernetes stopped it before its
    command exited (``STOPPED_JOB_REASONS``), else None."""
    failed = _conditions(job).get("Failed") or {}
    reason = str(failed.get("reason") or "")
    if failed.get("status") == "True" and reason in STOPPED_JOB_REASONS:
        return reason
    return None


def sandbox_pod_hint(sandbox: Obj) -> str | None:
    """The pod the controller names: annotation ``agents.x-k8s.io/pod-name`` or
    ``status.podName``."""
    annotated = (meta(sandbox).get("annotations") or {}).get(SANDBOX_POD_ANNOTATION)
    if annotated:
        return str(annotated)
    named = (sandbox.get("status") or {}).get("podName")
    return str(named) if named else None


def controller_ref(obj: Obj) -> Mapping[str, Any] | None:
    """The ownerReference with ``controller: true`` (an object has at most one), if any."""
    for ref in meta(obj).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller"):
            return ref
    return None


def controller_said(obj: Obj) -> str:
    """Who controls ``obj``, for a message: "it has no controller" or "it is controlled by
    <kind> <name>"."""
    ref = controller_ref(obj)
    if ref is None:
        return "it has no controller"
    return f"it is controlled by {ref.get('kind')} {ref.get('name')}"


def controlled_by(obj: Obj, owner_uid: str | None) -> bool:
    """True only when ``obj``'s controller is ``owner_uid``: a pod that nothing controls
    (made by hand) or that something else controls is not the workload's, whatever its
    labels or name say."""
    ref = controller_ref(obj)
    return bool(owner_uid) and ref is not None and ref.get("uid") == owner_uid


def controlled_by_other(obj: Obj, workload: str) -> bool:
    """True when something other than workload ``workload`` (a Sandbox or a Job of that
    name, any incarnation) controls ``obj``: a Deployment's pod, a CronJob's Job. Such an
    object is never ours, whatever labels it copied."""
    ref = controller_ref(obj)
    if ref is None:
        return False
    group = str(ref.get("apiVersion") or "").rpartition("/")[0]
    return (group, ref.get("kind")) not in WORKLOAD_KINDS or ref.get("name") != workload


def pick_pod(pods: Iterable[PodT], owner_uid: str | None) -> PodT | None:
    """The pod to use among candidates controlled by ``owner_uid``: Running and not
    terminating first, then not terminating, then the newest."""
    candidates = [p for p in pods if controlled_by(p, owner_uid)]
    if not candidates:
        return None

    def rank(pod: PodT) -> tuple[int, int, str]:
        running = (pod.get("status") or {}).get("phase") == "Running"
        return (int(running), int(not is_terminating(pod)),
                str(meta(pod).get("creationTimestamp") or ""))

    return max(candidates, key=rank)


def pod_phase(pod: Obj) -> str | None:
    phase = (pod.get("status") or {}).get("phase")
    return str(phase) if phase else None


def pod_not_running_reason(pod: Obj) -> str | None:
    """None when the pod is Running and not terminating, else why it is not usable (with
    the reason its container waits for, if it says one)."""
    name = name_of(pod)
    if is_terminating(pod):
        return f"Pod {name} is terminating"
    phase = pod_phase(pod)
    if phase != "Running":
        waiting = container_waiting(pod)
        said = f" ({waiting[0]}: {waiting[1]})" if waiting and waiting[1] else (
            f" ({waiting[0]})" if waiting else "")
        return f"Pod {name} is {phase or 'in an unknown phase'}{said}"
    return None


def container_waiting(pod: Obj, container: str = CONTAINER_NAME) -> tuple[str, str] | None:
    """(reason, message) of ``container`` (or the only container) while it waits to start
    (``state.waiting``), if it says a reason."""
    statuses = [s for s in (pod.get("status") or {}).get("containerStatuses") or []
                if isinstance(s, dict)]
    for status in [s for s in statuses if s.get("name") == container] or statuses[:1]:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return str(waiting["reason"]), " ".join(str(waiting.get("message") or "").split())
    return None


def pod_cannot_start(pod: Obj) -> str | None:
    """Why a Pending pod can never start by itself (its container waits for one of
    ``CANNOT_START_REASONS``): ``pod_not_running_reason``'s words; None otherwise."""
    waiting = container_waiting(pod)
    if is_terminating(pod) or pod_phase(pod) != "Pending" or waiting is None \
            or waiting[0] not in CANNOT_START_REASONS:
        return None
    return pod_not_running_reason(pod)


def container_exit_code(pod: Obj, container: str = CONTAINER_NAME) -> int | None:
    """The terminated exit code of ``container`` (or of the only container)."""
    statuses = [s for s in (pod.get("status") or {}).get("containerStatuses") or []
                if isinstance(s, dict)]
    chosen = [s for s in statuses if s.get("name") == container] or statuses[:1]
    for status in chosen:
        terminated = (status.get("state") or {}).get("terminated") or {}
        if "exitCode" in terminated:
            return int(terminated["exitCode"])
    return None


def job_exit_code(job: Obj, pods: Iterable[Obj]) -> int | None:
    """The exit code a finished (Succeeded or Failed) Job's own command ended with: its
    newest pod's container code. None while the Job runs, and when no pod of this Job
    (by controller uid) reports a code of its own: a pod being deleted (an active deadline,
    a destroy) was stopped, it did not end by itself."""
    if job_phase(job) not in (JobPhase.SUCCEEDED, JobPhase.FAILED):
        return None
    owner = uid_of(job)
    codes = sorted(
        ((str(meta(p).get("creationTimestamp") or ""), code) for p in pods
         if controlled_by(p, owner) and not is_terminating(p)
         and (code := container_exit_code(p)) is not None),
        reverse=True)
    return codes[0][1] if codes else None


def belongs_to(obj: Obj, lease_id: str, installation: str) -> bool:
    """True when the object's labels (and exact annotation, if present) name this lease
    and installation: the test for adopting an object a 409 revealed."""
    labels = labels_of(obj)
    if labels.get(LABEL_INSTALLATION) != installation:
        return False
    if labels.get(LABEL_LEASE_ID) != label_value(lease_id):
        return False
    exact = (meta(obj).get("annotations") or {}).get(ANNOTATION_LEASE_ID)
    return exact is None or exact == lease_id


def owner_uids(obj: Obj) -> list[str]:
    return [str(ref.get("uid")) for ref in meta(obj).get("ownerReferences") or []
            if ref.get("uid")]
