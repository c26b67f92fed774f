"""Small helpers over a lease row shared by the lifecycle tasks."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import datetime, timedelta

from models.schema import AnyLease, ClaimedLease, utcnow
from providers.base import LeaseHandle
from providers.spec import SandboxSpec


def new_lease_id() -> str:
    """Time-ordered and DNS-safe: 12 hex digits of milliseconds, then 20 random."""
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"


def sandbox_key(spec: SandboxSpec, provider: str, run_id: str) -> str:
    """The spec's key, or a hash of what identifies the sandbox (the run too, unless reused)."""
    if spec.sandbox_key:
        return spec.sandbox_key
    strategy = "reuse" if spec.reuse else f"ephemeral:{run_id}"
    parts = "|".join([spec.tenant, spec.thread_id or "", provider, spec.backend or "", strategy])
    return "sk-" + hashlib.sha256(parts.encode()).hexdigest()[:40]


def handle(lease: AnyLease | ClaimedLease) -> LeaseHandle:
    """What the provider needs to find the lease's resources. The backend is the one the
    provider reported; a lease that never became active (its acquire failed or died after
    creating something) has none yet, so the one its spec asked for, or "" (the provider's
    default, as its acquire used): never guessed, or a Job would be looked for as a Sandbox
    and left running."""
    backend = lease.backend or str((lease.spec or {}).get("backend") or "")
    return LeaseHandle(name=lease.provider_lease_id, backend=backend,
                       meta=dict(lease.provider_meta or {}))


# Why a lease past its absolute deadline is not handed to a run (resume check, reuse, touch).
EXPIRED = "expired: past its absolute deadline"


def expired(lease: AnyLease, now: datetime | None = None) -> bool:
    """Past its absolute deadline (ttl_s): no activity saves it; sweep.expire_leases ends
    it at its next tick, and nothing hands it to a run meanwhile."""
    return lease.deadline_at is not None and lease.deadline_at <= (now or utcnow())


def later(seconds: float) -> datetime:
    return utcnow() + timedelta(seconds=seconds)
