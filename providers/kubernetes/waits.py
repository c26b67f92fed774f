"""Readiness waits: one watch from a known resourceVersion under a monotonic deadline.

``wait_for`` starts from an object already in hand (the create's answer, or one read), so no
event between that read and the watch is lost. The watch restarts from the last
resourceVersion seen when the server ends it early or the connection breaks (a proxy or load
balancer cutting a long request), and from one fresh read when the server says 410 Expired.
It never sleeps and never polls; a watch that keeps failing gives up with the last error.
A wait on one object by name (``incarnation``: its uid) ends REPLACED when the name turns
out to hold another object: one deleted and made again between two watches (a 410 and a
read) shows no DELETED event, and what holds the name now may be anyone's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from providers.errors import TransientProviderError
from providers.kubernetes.client import Obj, WatchEvent
from providers.kubernetes.errors import KubeExpired
from providers.kubernetes.status import resource_version, uid_of

# A watch that the server ends at once, again and again, without any event.
MAX_EMPTY_RESTARTS = 10
# Consecutive watch requests that fail with a transient error (dropped connection, 5xx, 429)
# before the wait gives up and lets the task's retry policy take over.
MAX_BROKEN_WATCHES = 3


class WaitOutcome(StrEnum):
    SETTLED = "settled"  # ``settled(obj)`` became true
    DELETED = "deleted"  # the object went away
    REPLACED = "replaced"  # another object (another uid) holds its name now: ``obj``
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class WaitResult:
    outcome: WaitOutcome
    obj: Obj | None  # the last state seen


Watch = Callable[[str | None, int], Iterable[WatchEvent]]
Reread = Callable[[], Obj | None]  # None: the object is gone


def wait_for(*, initial: Obj, watch: Watch, reread: Reread, settled: Callable[[Obj], bool],
             deadline: float, clock: Callable[[], float] = time.monotonic,
             incarnation: str | None = None) -> WaitResult:
    """Wait until ``settled(obj)`` holds for the watched object, it is deleted, or
    ``deadline`` (a ``clock()`` value) passes. With ``incarnation`` (the uid of the one
    object watched), an object of another uid ends the wait as REPLACED, never SETTLED."""

    def replaced(obj: Obj) -> bool:
        return incarnation is not None and uid_of(obj) != incarnation

    last = initial
    if settled(last):
        return WaitResult(WaitOutcome.SETTLED, last)
    rv = resource_version(initial)
    empty_restarts = broken = 0
    while (remaining := deadline - clock()) > 0:
        saw_event = False
        try:
            for event in watch(rv, max(1, math.ceil(remaining))):
                rv = resource_version(event.obj) or rv
                if event.type == "BOOKMARK":
                    continue
                saw_event = True
                if event.type == "DELETED":
                    return WaitResult(WaitOutcome.DELETED, event.obj)
                if replaced(event.obj):
                    return WaitResult(WaitOutcome.REPLACED, event.obj)
                last = event.obj
                if settled(last):
                    return WaitResult(WaitOutcome.SETTLED, last)
                if clock() >= deadline:
                    break
        except KubeExpired:
            fresh = reread()
            if fresh is None:
                return WaitResult(WaitOutcome.DELETED, last)
            if replaced(fresh):
                return WaitResult(WaitOutcome.REPLACED, fresh)
            last, rv, saw_event = fresh, resource_version(fresh), True
            if settled(last):
                return WaitResult(WaitOutcome.SETTLED, last)
        except TransientProviderError:
            broken = 1 if saw_event else broken + 1
            if broken >= MAX_BROKEN_WATCHES:
                raise
            continue  # resume from the last resourceVersion seen: nothing is lost
        broken = 0
        empty_restarts = 0 if saw_event else empty_restarts + 1
        if empty_restarts > MAX_EMPTY_RESTARTS and deadline - clock() > 1:
            raise TransientProviderError(
                f"kubernetes: the watch kept ending without events ({empty_restarts} times); "
                "the API server or a proxy in between closes watches early"
            )
    return WaitResult(WaitOutcome.TIMED_OUT, last)
