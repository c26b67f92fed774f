"""The producer API for web backends (Django, FastAPI, Flask): validate, then enqueue.

Every function validates its input before anything reaches the broker (raising
``InvalidRequest`` with what was wrong) and returns the Celery ``AsyncResult``. Secrets in
a spec travel only in the message body; Flower, events and logs see them redacted.
A backend without leasekeeper installed can ``send_task`` the same names with the JSON
payloads documented in the README. With the broker down, every call raises
``BrokerUnavailable`` (transient: retry later) at once, instead of hanging (see ``_send``).
``task_status`` reads a sent task's state once, for a request handler that polls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
from celery import Task
from celery.result import AsyncResult

from providers.errors import (
    AcquireCancelled,
    BrokerUnavailable,
    ConfigError,
    InvalidRequest,
    LeasekeeperError,
)
from providers.kubernetes.manifests import backend_refusal
from providers.spec import (
    MIN_SUBSTRING_SECRET_CHARS,
    REDACTED,
    SandboxSpec,
    check_id,
    described,
    echo,
    hide_secret_values,
)
from tasks.acquire import acquire, parse_acquire
from tasks.broker_words import (
    BROKER_ERRORS,
    broker_error,
    broker_unreachable,
    database_missing,
    out_of_memory,
)
from tasks.destroy import checked_reason, destroy
from tasks.reclaim import reclaim
from tasks.redaction import scrub_text, secret_values
from tasks.resume import resume_check
from tasks.runs import attach_run as _attach
from tasks.runs import detach_run as _detach
from tasks.runs import finish_run as _finish
from tasks.runs import parse_finish
from tasks.runs import touch_lease as _touch
from tasks.sent_cut import sendable
from tasks.text import printable
from workers.pool_settings import resolve_spec
from workers.settings import (
    OFFERED_PROVIDERS,
    PROVIDER_NAMES,
    Settings,
    get_settings,
    provider_not_enabled,
)

# What a web backend imports from here (PEP 561: a user's `mypy --strict` sees only these as
# exported): the sending functions, the status reader and its types, and the errors a call
# raises (re-exported from providers/errors.py; LeasekeeperError is the root of them all).
__all__ = [
    "AcquireCancelled",
    "BrokerUnavailable",
    "ConfigError",
    "InvalidRequest",
    "LeasekeeperError",
    "SandboxSpec",
    "TaskState",
    "TaskStatus",
    "acquire_lease",
    "attach_run",
    "check_resumable",
    "destroy_lease",
    "detach_run",
    "finish_run",
    "reclaim_run",
    "task_status",
    "touch_lease",
]


def _id(task: Task, kind: str, value: object) -> str:
    """``value`` checked as ``task``'s ``kind`` field, refused in the words the worker
    refuses it with (tasks/base.py check_payload)."""
    try:
        return check_id(kind, value)
    except ValueError as exc:
        raise InvalidRequest(f"invalid {task.name} payload: {exc}") from None


# A send within this long of the last one that reached the broker skips the PING (a
# round trip per call otherwise: a tenth of a lifecycle's producer and Redis time).
BROKER_SEEN_S = 1.0
# A failed publish is not retried here (Celery's default tries four times, each waiting
# out the socket timeout of workers/app.py on a broker that went quiet): the caller gets
# BrokerUnavailable, which is transient, within one timeout.
PUBLISH_RETRY_POLICY = {"max_retries": 0}
_broker_seen_at = float("-inf")  # monotonic time of the last send that reached the broker


def _send(task: Task, kwargs: dict[str, Any]) -> AsyncResult:
    """Enqueue, or raise BrokerUnavailable at once. A PING first, unless a send reached
    the broker within BROKER_SEEN_S: after a failed round trip Celery would spend seconds
    retrying the result backend's subscription, then fail with a RuntimeError that asks
    for a restart. A broker lost since the last send fails the send itself, as
    BrokerUnavailable (publishing fails before any retry loop, or the result subscription
    after Celery's own reconnect attempt: ``_broker_error``), and the next send PINGs."""
    global _broker_seen_at
    try:
        if time.monotonic() - _broker_seen_at > BROKER_SEEN_S:
            client = getattr(task.app.backend, "client", None)  # the result backend's Redis
            if client is not None:
                client.ping()
        result = task.apply_async(kwargs=kwargs, retry_policy=PUBLISH_RETRY_POLICY)
    except (*BROKER_ERRORS, redis.ResponseError, RuntimeError) as exc:
        if database_missing(exc):  # a setting to fix, not a broker to wait for
            raise ConfigError(broker_unreachable(task.app.conf.broker_url, exc)) from None
        lost = exc if out_of_memory(exc) else broker_error(exc)
        if lost is None:
            raise
        _broker_seen_at = float("-inf")
        raise BrokerUnavailable(broker_unreachable(task.app.conf.broker_url, lost)) from None
    _broker_seen_at = time.monotonic()
    return result


class TaskState(StrEnum):
    """A task's state as Celery's result backend has it."""

    PENDING = "PENDING"  # waiting in its queue, or an id no task has (Celery cannot tell)
    RECEIVED = "RECEIVED"
    STARTED = "STARTED"
    RETRY = "RETRY"  # a transient failure: it runs again after a backoff
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    REVOKED = "REVOKED"
    REJECTED = "REJECTED"
    IGNORED = "IGNORED"


@dataclass(frozen=True)
class TaskStatus:
    """What ``task_status`` read: ``result`` is the task's answer (SUCCESS only),
    ``error`` the reason it failed (FAILURE) or is retried after (RETRY)."""

    state: TaskState
    result: Any = None
    error: str | None = None


TASK_ID_MAX_CHARS = 255


def task_status(task_id: str) -> TaskStatus:
    """The state of a task this API sent (the ``id`` of its ``AsyncResult``), read from the
    result backend once, without waiting: a request handler polls with it. InvalidRequest
    for what is no task id; BrokerUnavailable (transient) when the result backend's Redis
    cannot be read, in the wording of a failed send."""
    if (not isinstance(task_id, str) or not 0 < len(task_id) <= TASK_ID_MAX_CHARS
            or not printable(task_id) or any(c.isspace() for c in task_id)):
        raise InvalidRequest(f"task_id must be the id of a sent task (1-{TASK_ID_MAX_CHARS} "
                             f"characters, no spaces); got {described(task_id)}")
    found = AsyncResult(task_id, app=acquire.app)
    try:
        state, value = found.state, found.result
    except (*BROKER_ERRORS, redis.ResponseError, RuntimeError) as exc:
        settings = get_settings()
        setting = ("LEASEKEEPER_RESULT_BACKEND_URL" if settings.result_backend_url
                   else "LEASEKEEPER_BROKER_URL")
        url = str(acquire.app.conf.result_backend)
        if database_missing(exc):
            raise ConfigError(broker_unreachable(url, exc, False, setting)) from None
        lost = broker_error(exc)
        if lost is None:
            raise
        raise BrokerUnavailable(broker_unreachable(url, lost, False, setting)) from None
    known = TaskState(state)  # Celery's states, every one
    if known == TaskState.SUCCESS:
        return TaskStatus(known, result=value)
    if known in (TaskState.FAILURE, TaskState.RETRY) and isinstance(value, BaseException):
        return TaskStatus(known, error=_error_text(value))
    return TaskStatus(known)


def _error_text(error: BaseException) -> str:
    """A failed task's error as a person reads it. Celery's NotRegistered (a KeyError) says
    only the quoted name."""
    if type(error).__name__ == "NotRegistered" and error.args:
        ours = sorted(name for name in acquire.app.tasks if not name.startswith("celery."))
        return (f"unknown task {echo(error.args[0])}: no worker of this installation has a "
                f"task of that name (its tasks: {', '.join(ours)}); see the README's task "
                "table")
    return str(error) or type(error).__name__


def acquire_lease(run_id: str, spec: SandboxSpec | Mapping[str, Any] | None = None
                  ) -> AsyncResult:
    raw = dict(spec) if isinstance(spec, Mapping) else spec
    try:
        run_id, parsed = parse_acquire(run_id, raw)
        settings = get_settings()
        if parsed.pool is not None and settings.pools:
            # Refused here when this process knows the pools (a backend that does not
            # declare them leaves it to the worker): an unknown pool, a field its template
            # decides.
            resolve_spec(settings.pools, parsed)
        if parsed.provider is not None:
            check_provider(parsed.provider, settings)
        check_backend(parsed, settings)
    except InvalidRequest as exc:
        raise InvalidRequest(_without_secrets(str(exc), raw)) from None
    return _send(acquire, {"run_id": run_id, "spec": parsed.to_payload()})


def _without_secrets(message: str, spec: SandboxSpec | dict[str, Any] | None) -> str:
    """A refusal's text with the spec's secret values replaced by ``***`` wherever it
    quotes one (a provider, a quantity, a label or env name that repeats a secret): a
    backend shows it (a 422's body, an error tracker), and the worker's refusal of the
    same spec hides them too. Values too short to search for are replaced where quoted
    whole."""
    values = set(spec.secret_values().values() if isinstance(spec, SandboxSpec)
                 else secret_values(spec))
    message = str(hide_secret_values(message, values))  # those long enough to search for
    for value in values:
        if 0 < len(value) < MIN_SUBSTRING_SECRET_CHARS:
            message = message.replace(repr(value), repr(REDACTED))
    return message


def check_provider(name: str, settings: Settings) -> None:
    """Refuse a provider this process knows the workers cannot have. A web process that
    sets LEASEKEEPER_PROVIDERS keeps to that list; one that does not (most set only the
    broker URL) cannot know the workers' list, so it refuses only names no leasekeeper
    has: its own default (``local``) says nothing about the workers."""
    if "providers" in settings.model_fields_set:
        if name not in settings.providers:
            raise InvalidRequest(provider_not_enabled(
                name, settings.providers, "this process",
                "add it to LEASEKEEPER_PROVIDERS, here and on the workers, to use it"))
    elif name not in PROVIDER_NAMES:
        raise InvalidRequest(
            f"unknown provider {name!r}: leasekeeper has the providers "
            f"{OFFERED_PROVIDERS}; name one the workers enable "
            "(their LEASEKEEPER_PROVIDERS)")


def check_backend(spec: SandboxSpec, settings: Settings) -> None:
    """Refuse, in the worker's words (its provider's check_spec), a backend the Kubernetes
    provider does not have when this process knows the spec goes to it: named in the spec,
    or this process's own LEASEKEEPER_PROVIDER when it sets one. A pool's template decides
    the backend: left to the worker."""
    provider = spec.provider or (settings.provider if "provider" in settings.model_fields_set
                                 else None)
    if provider == "kubernetes" and spec.pool is None:
        problem = backend_refusal(spec.backend)
        if problem:
            raise InvalidRequest(problem)


def check_resumable(lease_id: str) -> AsyncResult:
    return _send(resume_check, {"lease_id": _id(resume_check, "lease_id", lease_id)})


def destroy_lease(lease_id: str, reason: str | None = "requested") -> AsyncResult:
    """Send lease.destroy. The reason goes whole when the payload fits, else cut to fit
    as finish_run's error is (tasks/sent_cut.py): never to the 200 characters the store
    keeps, which the worker cuts after scrubbing the run's secrets, seen whole. Sent as
    the caller wrote it (JSON carries any character): the worker replaces what no store
    holds (tasks/text.py ``storable``) after that scrub, so its marks see each secret as
    the acquire gave it."""
    kwargs: dict[str, Any] = {"lease_id": _id(destroy, "lease_id", lease_id)}
    kwargs["reason"] = sendable(scrub_text(checked_reason(reason)), kwargs, "reason",
                                get_settings().max_payload_bytes)
    return _send(destroy, kwargs)


def finish_run(run_id: str, status: str, exit_code: int | None = None,
               error: str | None = None) -> AsyncResult:
    """Send run.finish. The error goes whole when the payload fits, else cut to fit
    (tasks/sent_cut.py): never to the 2,000 characters a run keeps, which the worker cuts
    after scrubbing the run's secrets, seen whole; not cleaned of control characters
    before (the worker does, after its scrub: see destroy_lease)."""
    run_id, parsed = parse_finish(run_id, status, exit_code, error)
    kwargs: dict[str, Any] = {"run_id": run_id, "status": parsed.value,
                              "exit_code": exit_code, "error": None}
    if error is not None:
        kwargs["error"] = sendable(scrub_text(error), kwargs, "error",
                                   get_settings().max_payload_bytes)
    return _send(_finish, kwargs)


def detach_run(run_id: str) -> AsyncResult:
    return _send(_detach, {"run_id": _id(_detach, "run_id", run_id)})


def attach_run(run_id: str) -> AsyncResult:
    return _send(_attach, {"run_id": _id(_attach, "run_id", run_id)})


def touch_lease(lease_id: str) -> AsyncResult:
    return _send(_touch, {"lease_id": _id(_touch, "lease_id", lease_id)})


def reclaim_run(run_id: str) -> AsyncResult:
    return _send(reclaim, {"run_id": _id(reclaim, "run_id", run_id)})
