"""The task queues (lanes) and which task goes to which, so cleanup is never starved.

Every queue name derives from ``LEASEKEEPER_TASK_QUEUE`` (the base, ``celery`` by default),
so two installations sharing a Redis stay apart: ``<base>.cleanup``, ``<base>.sweeps``,
``<base>`` itself (the default queue: what a by-name sender reaches without naming a
queue), ``<base>.acquire`` and ``<base>.pool``. A worker without ``-Q`` consumes all five,
and it polls them in that order (kombu's ``priority`` queue order), so a destroy or
reclaim waits for at most one running task per pool process, never behind the acquires
queued before it, and a warm pool's refill never delays a run's acquire (or claim). ``-Q``
splits them over workers; production runs a separate cleanup worker (see the README).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from kombu.entity import Queue


class Lane(StrEnum):
    CLEANUP = "cleanup"  # ends of lifecycles: destroy, reclaim, run changes, touch
    SWEEPS = "sweeps"  # celery beat's ticks
    DEFAULT = "default"  # the base queue itself: by-name sends with no queue, diagnostics
    ACQUIRE = "acquire"  # provider waits: acquire (up to the acquire timeout), resume check
    POOL = "pool"  # warm pool members being created: only when no run is waiting


# The order a worker polls its queues in: the first non-empty queue is served first.
POLL_ORDER = (Lane.CLEANUP, Lane.SWEEPS, Lane.DEFAULT, Lane.ACQUIRE, Lane.POOL)

TASK_LANES: dict[str, Lane] = {
    "lease.acquire": Lane.ACQUIRE,
    "lease.resume_check": Lane.ACQUIRE,
    "lease.destroy": Lane.CLEANUP,
    "sandbox.reclaim": Lane.CLEANUP,
    "run.finish": Lane.CLEANUP,
    "run.detach": Lane.CLEANUP,
    "run.attach": Lane.CLEANUP,
    "lease.touch": Lane.CLEANUP,
    "pool.provision": Lane.POOL,
}
SWEEP_PREFIX = "sweep."


def lane_of(task_name: str) -> Lane:
    if task_name.startswith(SWEEP_PREFIX):
        return Lane.SWEEPS
    return TASK_LANES.get(task_name, Lane.DEFAULT)


def queue_name(base: str, lane: Lane) -> str:
    return base if lane is Lane.DEFAULT else f"{base}.{lane}"


def lanes_served(reply: Mapping[str, Any] | None, base: str) -> dict[str, set[Lane]]:
    """Each worker in a reply to Celery's ``active_queues`` broadcast (``{hostname:
    [{"name": queue, ...}, ...]}``) that consumes a queue of the installation whose base
    queue is ``base``, with the lanes it consumes (``-Q`` may give it a few): what answers
    a ping on a shared Redis may serve another installation."""
    by_queue = {queue_name(base, lane): lane for lane in Lane}
    found: dict[str, set[Lane]] = {}
    for host, queues in (reply or {}).items():
        lanes = {by_queue[q["name"]] for q in queues or []
                 if isinstance(q, Mapping) and q.get("name") in by_queue}
        if lanes:
            found[host] = lanes
    return found


def task_queues(base: str) -> list[Queue]:
    """Every queue of the installation whose base queue is ``base``, in poll order."""
    return [Queue(queue_name(base, lane))  # type: ignore[no-untyped-call]
            for lane in POLL_ORDER]


class LaneRouter:
    """A Celery router: each task to its lane's queue under the app's current default
    queue (read at send time, so a client that switches ``task_default_queue`` to reach
    another installation routes there too). An explicit ``queue=`` still wins."""

    def __init__(self, conf: Any) -> None:
        self.conf = conf

    def __call__(self, name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                 **_: Any) -> dict[str, str]:
        return {"queue": queue_name(str(self.conf.task_default_queue), lane_of(name))}
