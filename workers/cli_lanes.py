"""Which lanes (workers/queues.py) the answering workers serve, for `leasekeeper status` and
`health`: the ``active_queues`` broadcast read by ``lanes_served``, as the exporter counts
it (leasekeeper_lane_workers), with each lane's tasks waiting in Redis.

A lane with tasks waiting and no worker consuming it needs a person: they wait for ever
(a deploy split by ``-Q`` that lost a worker). An empty lane without a worker is only a
note: nothing waits yet, a split deploy may leave a lane it never uses (the pool lane
without warm pools) unserved, and a split worker restarting leaves its lane unserved for a
moment; the LaneUnserved alert says it when that lasts."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import redis

from workers.queues import POLL_ORDER, Lane, lanes_served, queue_name


class LaneService(StrEnum):
    SERVED = "served"  # a worker that answered consumes it
    UNSERVED_EMPTY = "unserved_empty"  # no worker consumes it; nothing waits (a note)
    UNSERVED_WAITING = "unserved_waiting"  # no worker consumes it; tasks wait (a problem)


def lanes_online(timeout_s: float, base: str, node: str | None = None
                 ) -> dict[str, set[Lane]]:
    """The workers that answer within ``timeout_s`` and consume a queue of the installation
    whose base queue is ``base`` (LEASEKEEPER_TASK_QUEUE), with the lanes each consumes:
    one of another installation on the same Redis is not ours."""
    from workers.app import app

    replies = app.control.broadcast("active_queues", reply=True, timeout=timeout_s,
                                    destination=[node] if node else None,
                                    limit=1 if node else None)
    served: dict[str, set[Lane]] = {}
    for reply in replies or []:
        served.update(lanes_served(reply, base))
    return served


def lane_rows(client: redis.Redis[bytes], base: str, served: Mapping[str, set[Lane]]
              ) -> list[dict[str, Any]]:
    """Every lane in poll order: its queue, the tasks waiting in it, the workers consuming
    it and what that makes it (LaneService)."""
    rows = []
    for lane in POLL_ORDER:
        queue = queue_name(base, lane)
        waiting = int(client.llen(queue))
        workers = sorted(host for host, lanes in served.items() if lane in lanes)
        service = (LaneService.SERVED if workers else LaneService.UNSERVED_WAITING
                   if waiting else LaneService.UNSERVED_EMPTY)
        rows.append({"lane": lane.value, "queue": queue, "waiting": waiting,
                     "workers": workers, "service": service.value})
    return rows


def unserved(rows: list[dict[str, Any]]) -> list[str]:
    """A problem for each lane with tasks waiting and no worker consuming it."""
    return [f"lane {row['lane']}: {row['waiting']} task(s) wait in {row['queue']} and no "
            f"worker consumes it: start a worker with -Q {row['queue']} (or add it to a "
            "worker's -Q), or one without -Q"
            for row in rows if row["service"] == LaneService.UNSERVED_WAITING]


def idle(rows: list[dict[str, Any]]) -> list[str]:
    """A note for each empty lane no worker consumes: a task sent to it would wait."""
    return [f"lane {row['lane']}: no worker consumes {row['queue']} (nothing waits in it "
            "now; a task sent to it would wait until one does)"
            for row in rows if row["service"] == LaneService.UNSERVED_EMPTY]
