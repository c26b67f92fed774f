"""The ``faulty`` provider: the local provider with faults injected at the provider seam.

A test writes a fault plan (JSON) to ``LEASEKEEPER_FAULTS_FILE``; each provider call takes
the first matching rule and consumes one of its ``times``::

    {"acquire": [{"fault": "transient", "when": "after", "times": 1}],
     "destroy": [{"fault": "terminal", "times": 2}],
     "claim": [{"fault": "kill_worker", "when": "after", "times": 1}]}

``fault`` is ``transient`` | ``terminal`` | ``conflict`` | ``value_error`` (not a
ProviderError: a provider bug, or a malformed API reply) | ``invalid_request`` (the
provider's own check of its input refusing it) | ``kill_worker`` (SIGKILL the
calling process, as a crash would) | ``slow`` (the call takes ``seconds`` longer, as a slow
API server's would, then goes on); ``when`` is ``before`` (nothing done) or ``after``
(the real call happened, then the fault: for acquire, "the workload exists but the next
step failed"; for claim, "the run's data was delivered, then the worker died"). The
operations are the provider contract's: acquire, resume_check, claim, destroy,
list_managed. The plan file is shared by every worker process, consumed under a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from providers.base import (
    Acquired,
    AcquireRequest,
    Claimed,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
    ManagedResource,
    ResumeResult,
)
from providers.errors import (
    InvalidRequest,
    ProviderConflict,
    TerminalProviderError,
    TransientProviderError,
)
from providers.local import LocalProvider
from providers.spec import SandboxSpec

T = TypeVar("T")


class FaultPlan:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, plan: dict[str, list[dict[str, Any]]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, self.path)

    def take(self, operation: str, when: str) -> dict[str, Any] | None:
        """Consume one matching rule; return it, or None."""
        if not self.path.exists():
            return None
        with open(self.path, "r+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            plan = json.loads(handle.read() or "{}")
            for rule in plan.get(operation, []):
                if rule.get("when", "before") == when and rule.get("times", 1) > 0:
                    rule["times"] = rule.get("times", 1) - 1
                    rule["taken"] = rule.get("taken", 0) + 1
                    handle.seek(0)
                    handle.truncate()
                    handle.write(json.dumps(plan))
                    return dict(rule)
        return None


class FaultyProvider:
    name = "faulty"

    def __init__(self, inner: LocalProvider, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def _fire(self, operation: str, when: str) -> None:
        rule = self.plan.take(operation, when)
        if rule is None:
            return
        fault = str(rule["fault"])
        message = f"injected {fault} fault in {operation} ({when})"
        if fault == "transient":
            raise TransientProviderError(message)
        if fault == "terminal":
            raise TerminalProviderError(message)
        if fault == "conflict":
            raise ProviderConflict(message)
        if fault == "value_error":
            raise ValueError(f"{message}: malformed provider reply")
        if fault == "invalid_request":
            raise InvalidRequest(f"{message}: refused input")
        if fault == "kill_worker":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "slow":
            time.sleep(float(rule.get("seconds", 2.0)))
            return
        raise ValueError(f"unknown fault {fault!r} in {self.plan.path}")

    def _around(self, operation: str, call: Callable[[], T]) -> T:
        self._fire(operation, "before")
        result = call()
        self._fire(operation, "after")
        return result

    def lease_name(self, lease_id: str) -> str:
        return self.inner.lease_name(lease_id)

    def check_spec(self, spec: SandboxSpec) -> None:
        self.inner.check_spec(spec)

    def acquire(self, request: AcquireRequest) -> Acquired:
        return self._around("acquire", lambda: self.inner.acquire(request))

    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        return self._around("resume_check", lambda: self.inner.resume_check(handle, timeout_s))

    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        return self._around("claim", lambda: self.inner.claim(handle, request))

    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        return self._around("destroy", lambda: self.inner.destroy(handle))

    def list_managed(self) -> list[ManagedResource]:
        return self._around("list_managed", self.inner.list_managed)
