"""Whether the Job controller could make a Job's pod, read from the Events it records on
the Job: ``SuccessfulCreate`` (a pod exists), or ``FailedCreate`` (the API server refused
the pod: a used-up ResourceQuota, a LimitRange, a missing ServiceAccount, an admission
webhook). A Job whose pod is refused stays "active" with no pod at all, so without this an
acquire would give a lease on nothing.

Reading Events needs ``list`` and ``watch`` on ``events`` (deploy/rbac/role.yaml). They
are optional: without them the verdict is UNKNOWN, said once per process, and the
acquire goes on as it did before (the run finds out when its sandbox never answers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from providers.errors import ProviderError, TerminalProviderError, TransientProviderError
from providers.kubernetes.client import KubeApi, Obj
from providers.kubernetes.errors import forbidden
from providers.kubernetes.status import uid_of
from providers.kubernetes.waits import WaitOutcome, wait_for

log = logging.getLogger("leasekeeper.kubernetes")

CREATED, REFUSED = "SuccessfulCreate", "FailedCreate"
_CREATED_POD = "Created pod: "  # how the Job controller's SuccessfulCreate names the pod

# What a FailedCreate message means beyond FORBIDDEN_NOT_RBAC's (quota, webhook, a
# namespace being deleted): needle in the API server's message -> what to fix. Terminal:
# none of these goes away by itself.
REFUSAL_HINTS: tuple[tuple[str, str], ...] = (
    ("service account", "the pod's ServiceAccount does not exist in the namespace: create "
     "it, or name one that exists"),
    ("per Container", "a LimitRange in the namespace refuses the pod's resources: give the "
     "spec resources within it, or change the LimitRange (kubectl describe limitrange)"),
    ("per Pod", "a LimitRange in the namespace refuses the pod's resources: give the spec "
     "resources within it, or change the LimitRange (kubectl describe limitrange)"),
    ("LimitRange", "a LimitRange in the namespace refuses the pod: kubectl describe "
     "limitrange"),
)


class JobStart(StrEnum):
    STARTED = "started"  # the controller made a pod
    REFUSED = "refused"  # the API server refused the pod (``Verdict.message`` says why)
    UNKNOWN = "unknown"  # neither within the wait, or Events may not be read


@dataclass(frozen=True)
class Verdict:
    outcome: JobStart
    message: str = ""  # the FailedCreate (or SuccessfulCreate) Event's message

    @property
    def pod(self) -> str | None:
        """The pod a STARTED verdict's Event names (the Job controller says ``Created pod:
        <name>``), if it names one."""
        said = self.message.partition(_CREATED_POD)[2].strip()
        return said if self.outcome is JobStart.STARTED and said else None

    def error(self, job_name: str) -> ProviderError:
        """The acquire's error for a REFUSED verdict (``pod_refused``)."""
        return pod_refused(f"the Job controller could not create the pod of Job {job_name}",
                           self.message, "the Job and its Secret were removed")


def pod_refused(what: str, message: str, removed: str) -> ProviderError:
    """The acquire's error for a workload whose pod the API server refused (``message``,
    its words, as the workload's controller reported them): transient for a used-up quota
    (it frees up), terminal otherwise; it quotes the API server and says what to fix
    (``removed``: what the acquire removed, said when nothing more specific is known)."""
    said = " ".join(message.split())[:300]
    text = f"kubernetes: {what}"
    known = forbidden(403, said)
    if known is not None:
        error_type = TransientProviderError if known.transient else TerminalProviderError
        return error_type(f"{text} ({said}); {known.hint}")
    hint = next((h for needle, h in REFUSAL_HINTS if needle in said),
                f"fix what the message names; {removed}")
    return TerminalProviderError(f"{text} ({said}); {hint}")


class _Said:
    """Whether this process has said that it may not read Events."""

    events_forbidden = False


def _verdict_of(events: list[Obj]) -> Verdict | None:
    """The verdict of the Job's Events so far (a pod made wins: the controller may have
    refused one and made the next), or None if they say neither."""
    reasons = {str(event.get("reason")): event for event in events}
    if CREATED in reasons:
        return Verdict(JobStart.STARTED, str(reasons[CREATED].get("message") or ""))
    if REFUSED in reasons:
        return Verdict(JobStart.REFUSED, str(reasons[REFUSED].get("message") or ""))
    return None


def job_start(api: KubeApi, job: Obj, wait_s: float,
              clock: Callable[[], float] = time.monotonic) -> Verdict:
    """The Job controller's verdict on ``job``'s pod, waiting up to ``wait_s`` (0: what the
    Events say now) with one list and one watch of the Events on that Job."""
    selector = f"involvedObject.uid={uid_of(job)}"
    seen: list[Obj] = []

    def current() -> Obj:
        listed = api.list_events_versioned(selector)
        seen[:] = listed.items
        # a stand-in carrying the list's resourceVersion: the watch starts where it ended
        return {"metadata": {"resourceVersion": listed.resource_version}}

    try:
        initial = current()
        found = _verdict_of(seen)
        if found is not None or wait_s <= 0:
            return found or Verdict(JobStart.UNKNOWN)
        result = wait_for(
            initial=initial,
            watch=lambda rv, timeout: api.watch_events(selector, rv, timeout),
            reread=current,
            settled=lambda event: _verdict_of([*seen, event]) is not None,
            deadline=clock() + wait_s, clock=clock)
    except TerminalProviderError as exc:
        if exc.status != 403:
            raise
        if not _Said.events_forbidden:
            _Said.events_forbidden = True
            log.warning("cannot read Events (%s): a Job whose pod the API server refuses is "
                        "not noticed at acquire; grant list and watch on events "
                        "(deploy/rbac/role.yaml)", exc)
        return Verdict(JobStart.UNKNOWN)
    if result.outcome is WaitOutcome.SETTLED and result.obj is not None:
        return _verdict_of([*seen, result.obj]) or Verdict(JobStart.UNKNOWN)
    return Verdict(JobStart.UNKNOWN)
