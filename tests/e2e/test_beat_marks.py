"""Beat's liveness marks in a real Redis (workers/heartbeats.py) after Redis lost them:
`leasekeeper status` must not call every sweep late the moment Redis comes back empty."""

from __future__ import annotations

import time
import uuid

import redis

from tests.services import RedisServer
from workers.cli_status import sweep_ticks
from workers.heartbeats import beat_started, mark_beat, mark_sweep
from workers.settings import Settings


def test_a_redis_that_lost_its_data_gives_the_sweeps_their_grace_again(
        redis_server: RedisServer) -> None:
    queue = f"marks-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_server.url)
    settings = Settings(broker_url=redis_server.url, task_queue=queue)
    long_ago = time.time() - 100_000  # beat started more than 3 intervals of every sweep ago
    mark_beat(client, queue, 30, started=long_ago)
    assert beat_started(client, queue) == long_ago
    for key in client.scan_iter(f"leasekeeper:{queue}:*"):  # what a restart without
        client.delete(key)                                # persistence leaves: nothing
    before = time.time()
    mark_beat(client, queue, 30)  # the same beat's next tick
    restored = beat_started(client, queue)
    assert restored is not None and restored >= before
    assert not any(row["late"] for row in sweep_ticks(settings, client))
    # A later tick leaves the mark alone; a sweep that ran is judged by its own tick.
    mark_beat(client, queue, 30)
    assert beat_started(client, queue) == restored
    mark_sweep(client, queue, {"sweep": "sweep.orphans", "run": "ran"})
    orphans = next(r for r in sweep_ticks(settings, client) if r["sweep"] == "sweep.orphans")
    assert orphans["last_tick_at"] is not None and not orphans["late"]
    client.close()
