"""A repeated ``lease.acquire`` of a run: the same spec, or a refusal.

A run gets one sandbox, made for one spec: a run id is an idempotency key, and the same key
with other parameters is an error, not the earlier answer (as with Stripe's idempotency
keys). A redelivery, a retry or a copy sent twice at once carries the same spec and is
answered ``already_acquired`` (or goes on with the provisioning lease); the same run id
with another spec is refused with ``InvalidRequest`` naming the run, its lease and the
fields that differ (never a value), and the run and its lease are left as they are.

What is compared is the spec as the lease stored it (``lease.spec``: ``redacted()`` of the
spec after its pool's template was merged in, ``resolve_spec``) with this request's, made
the same way; the lease row is the one the repeated acquire reads anyway, so the check
adds no store statement (and none at all to a new run's acquire).

- A sandbox of the run's own (``reuse`` false): every field counts.
- A shared sandbox (``reuse`` true) was made from the spec of the thread's run that
  created it; a later run takes it as it is (its env, command, ttl... are not used), so
  for it only what selects the sandbox counts: the sandbox key its fields make (tenant,
  thread_id, provider, backend, or sandbox_key), the provider and ``reuse``.
- Secret values are stored as ``***``: a changed secret *value* cannot be seen, and is
  answered as the same spec (a secret added, removed or renamed is a difference).
"""

from __future__ import annotations

from typing import Any

from models.schema import AnyLease
from providers.errors import InvalidRequest
from providers.spec import SandboxSpec

# The fields that select a shared sandbox (tasks/leases.py sandbox_key)
SELECTING_FIELDS = ("provider", "backend", "tenant", "thread_id", "sandbox_key", "reuse",
                    "pool")


def differing_fields(lease: AnyLease, spec: SandboxSpec, key: str, provider: str) -> list[str]:
    """The names of the fields (top level) in which ``spec`` differs from the spec ``lease``
    was acquired with, as far as they count (the module's doc); [] if none does."""
    stored: dict[str, Any] = lease.spec or {}
    mine = spec.redacted()
    if not lease.reuse and not spec.reuse:
        return sorted(f for f in stored.keys() | mine.keys() if stored.get(f) != mine.get(f))
    if (lease.sandbox_key, lease.provider, lease.reuse) == (key, provider, spec.reuse):
        return []
    named = [f for f in SELECTING_FIELDS if stored.get(f) != mine.get(f)]
    return named or ["sandbox_key"]  # the same fields, but another run made the key


def require_same_spec(run_id: str, lease: AnyLease, spec: SandboxSpec, key: str,
                      provider: str) -> None:
    """InvalidRequest if this acquire of ``run_id`` asks for another spec than its lease
    ``lease`` was acquired with; nothing is written either way."""
    fields = differing_fields(lease, spec, key, provider)
    if fields:
        raise InvalidRequest(
            f"run {run_id} already has lease {lease.lease_id} ({lease.state}), acquired with "
            f"another spec (differing fields: {', '.join(fields)}); a run gets one sandbox: "
            "start a new run (a new run_id) for this spec, or send the same spec")
