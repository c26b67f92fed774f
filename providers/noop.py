"""The ``noop`` provider: creates nothing, answers at once. For benchmarks of bookkeeping."""

from __future__ import annotations

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
    ResumeResult,
)
from providers.errors import unknown_backend
from providers.spec import SandboxSpec


class NoopProvider:
    name = "noop"

    def lease_name(self, lease_id: str) -> str:
        return f"lk-{lease_id}"

    def check_spec(self, spec: SandboxSpec) -> None:
        if spec.backend not in (None, "none"):
            raise unknown_backend(self.name, spec.backend, "none")

    def acquire(self, request: AcquireRequest) -> Acquired:
        return Acquired(AcquireOutcome.CREATED, "none", {})

    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        return ResumeResult.resumable()

    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        return Claimed(ClaimOutcome.CLAIMED)

    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        return DestroyOutcome.DESTROYED

    def list_managed(self) -> list[ManagedResource]:
        return []
