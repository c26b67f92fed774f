"""The producer API for web backends (Django, FastAPI, Flask): validate, then enqueue.

Every function validates its input before anything reaches the broker (raising
``InvalidRequest`` with what was wrong) and returns the Celery ``AsyncResult``. Secrets in
a spec travel only in the message body; Flower, events and logs see them redacted.
A backend without leasekeeper installed can ``send_task`` the same names with the JSON
payloads documented in the README.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery.result import AsyncResult

from providers.errors import InvalidRequest
from providers.spec import SandboxSpec, check_id
from tasks.acquire import acquire, parse_acquire
from tasks.destroy import destroy
from tasks.reclaim import reclaim
from tasks.resume import resume_check
from tasks.runs import attach_run as _attach
from tasks.runs import detach_run as _detach
from tasks.runs import finish_run as _finish
from tasks.runs import parse_finish
from tasks.runs import touch_lease as _touch
from workers.settings import get_settings


def _id(kind: str, value: object) -> str:
    try:
        return check_id(kind, value)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def acquire_lease(run_id: str, spec: SandboxSpec | Mapping[str, Any] | None = None
                  ) -> AsyncResult:
    run_id, parsed = parse_acquire(run_id, dict(spec) if isinstance(spec, Mapping) else spec)
    providers = get_settings().providers
    if parsed.provider is not None and parsed.provider not in providers:
        raise InvalidRequest(
            f"unknown provider {parsed.provider!r}: this installation enables "
            f"{', '.join(providers)} (LEASEKEEPER_PROVIDERS)"
        )
    return acquire.apply_async(kwargs={"run_id": run_id, "spec": parsed.to_payload()})


def check_resumable(lease_id: str) -> AsyncResult:
    return resume_check.apply_async(kwargs={"lease_id": _id("lease_id", lease_id)})


def destroy_lease(lease_id: str, reason: str = "requested") -> AsyncResult:
    return destroy.apply_async(kwargs={"lease_id": _id("lease_id", lease_id),
                                       "reason": str(reason)[:200]})


def finish_run(run_id: str, status: str, exit_code: int | None = None,
               error: str | None = None) -> AsyncResult:
    run_id, parsed = parse_finish(run_id, status, exit_code)
    return _finish.apply_async(kwargs={"run_id": run_id, "status": parsed.value,
                                       "exit_code": exit_code, "error": error})


def detach_run(run_id: str) -> AsyncResult:
    return _detach.apply_async(kwargs={"run_id": _id("run_id", run_id)})


def attach_run(run_id: str) -> AsyncResult:
    return _attach.apply_async(kwargs={"run_id": _id("run_id", run_id)})


def touch_lease(lease_id: str) -> AsyncResult:
    return _touch.apply_async(kwargs={"lease_id": _id("lease_id", lease_id)})


def reclaim_run(run_id: str) -> AsyncResult:
    return reclaim.apply_async(kwargs={"run_id": _id("run_id", run_id)})
