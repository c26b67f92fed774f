"""The provider error log: every ProviderError a provider call raises is one row of
``provider_errors`` in the store (provider, call, class, HTTP status, error type; never the
message, which could quote a secret), so the metrics exporter can count provider API errors
by class and status from any worker process. A destroy that failed in several parts is
one row per failed part: each was its own API error.

Recorded at the provider boundary: :class:`Runtime.provider` hands out every provider
wrapped in :class:`RecordingProvider`, so each attempt of a retried task (and each sweep's
call) is counted, and no task code changes. A failure to record is logged and never
changes what the call raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from celery import current_task

from models.observe import ErrorRecord, Observe
from models.schema import ProviderErrorClass
from models.store import Store
from providers.base import (
    Acquired,
    AcquireRequest,
    Claimed,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
    ManagedResource,
    Provider,
    ResumeResult,
)
from providers.errors import (
    AcquireCleanupIncomplete,
    DestroyIncomplete,
    LeasekeeperError,
    ProviderError,
    is_transient,
)
from providers.spec import SandboxSpec

log = logging.getLogger("leasekeeper.provider_errors")
T = TypeVar("T")


def records_of(provider: str, operation: str, task: str | None,
               exc: ProviderError) -> list[ErrorRecord]:
    """The rows one raised error stands for: one, or one per failed part of a destroy. An
    acquire whose own cleanup failed stands for the acquire's error (its cause)."""
    if isinstance(exc, AcquireCleanupIncomplete) and isinstance(exc.__cause__, ProviderError):
        exc = exc.__cause__
    parts = ([f.error for f in exc.failures]
             if isinstance(exc, DestroyIncomplete) and exc.failures else [exc])
    return [ErrorRecord(provider, operation, task,
                        ProviderErrorClass.TRANSIENT if is_transient(part)
                        else ProviderErrorClass.TERMINAL,
                        part.status, type(part).__name__) for part in parts]


def _task_name() -> str | None:
    task = current_task
    name = getattr(task, "name", None) if task else None
    return str(name)[:64] if name else None


class RecordingProvider:
    """``inner`` with every ProviderError its calls raise recorded in the store. Anything
    but the provider contract's calls is passed through to ``inner`` untouched."""

    def __init__(self, inner: Provider, store: Store, keep: int) -> None:
        self.inner, self.store, self.keep = inner, store, keep
        self.name = inner.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _record(self, operation: str, exc: ProviderError) -> None:
        try:
            Observe(self.store).record_provider_errors(
                records_of(self.name, operation, _task_name(), exc), self.keep)
        except LeasekeeperError as record_exc:
            log.warning("could not record a %s %s error: %s", self.name, operation,
                        record_exc)

    def _call(self, operation: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except ProviderError as exc:
            self._record(operation, exc)
            raise

    def lease_name(self, lease_id: str) -> str:
        return self.inner.lease_name(lease_id)

    def check_spec(self, spec: SandboxSpec) -> None:
        # A refused spec is checked locally, before any API call: not an API error.
        self.inner.check_spec(spec)

    def acquire(self, request: AcquireRequest) -> Acquired:
        return self._call("acquire", lambda: self.inner.acquire(request))

    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        return self._call("resume_check", lambda: self.inner.resume_check(handle, timeout_s))

    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        return self._call("claim", lambda: self.inner.claim(handle, request))

    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        return self._call("destroy", lambda: self.inner.destroy(handle))

    def list_managed(self) -> list[ManagedResource]:
        return self._call("list_managed", self.inner.list_managed)
