"""What an operator does to a lease by hand, shared by `leasekeeper leases retry|forget|
destroy` and the console's buttons, so both take exactly the same path.

retry and forget act only on abandoned leases (one guarded transition each); destroy
sends the ordinary ``lease.destroy`` task (live and pending_cleanup leases).
"""

from __future__ import annotations

import re
from enum import StrEnum

from models.schema import LeaseState, utcnow
from models.store import Store

# The reasons leasekeeper writes for an operator's destroy: `leases destroy` without
# --reason, and the console's (its basic-auth user's name, never a run's secret). They
# hold no caller text, so a destroy never searches or withholds them (tasks/destroy.py).
OPERATOR_REASON = "operator"
_CONSOLE_REASON = re.compile(r"operator [^\s()]{1,128} \(console\)")


def console_reason(user: str) -> str:
    return f"operator {user} (console)"


def operators_own(reason: str) -> bool:
    """``reason`` is one leasekeeper writes for an operator (no run's secret in it)."""
    return reason == OPERATOR_REASON or _CONSOLE_REASON.fullmatch(reason) is not None


class OperatorAction(StrEnum):
    RETRY = "retry"  # abandoned -> pending_cleanup, fresh attempts, due at once
    FORGET = "forget"  # abandoned -> destroyed (the operator removed it by hand)
    DESTROY = "destroy"  # send lease.destroy now


def retry_abandoned(store: Store, lease_id: str, actor: str = "operator") -> bool:
    """Give an abandoned lease a fresh set of cleanup attempts; False if not abandoned."""
    return store.transition(
        lease_id, {LeaseState.ABANDONED}, LeaseState.PENDING_CLEANUP,
        f"{actor}: retry cleanup", cleanup_attempts=0, next_cleanup_at=utcnow()) is not None


def forget_abandoned(store: Store, lease_id: str, reason: str = "by operator",
                     actor: str = "operator") -> bool:
    """Mark an abandoned lease destroyed; False if not abandoned."""
    return store.transition(
        lease_id, {LeaseState.ABANDONED}, LeaseState.DESTROYED,
        f"{actor}: forgotten ({reason})", end_reason="forgotten",
        cleanup_attempts=0) is not None


def request_destroy(lease_id: str, reason: str = OPERATOR_REASON) -> str:
    """Send lease.destroy for the lease; returns the task id."""
    from tasks.producer import destroy_lease

    return str(destroy_lease(lease_id, reason).id)
