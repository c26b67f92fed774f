"""Liveness marks in Redis that `leasekeeper status` and `health --beat` read.

    leasekeeper:<queue>:beat                 beat's last scheduler tick (epoch seconds);
                                             written by HeartbeatScheduler (workers/beat.py),
                                             deleted by its clean shutdown
    leasekeeper:<queue>:beat:started         when that beat process started (or, if
                                             Redis lost it, its first tick after that)
    leasekeeper:<queue>:sweep:<name>:last    a sweep's last tick that ran: when, took_ms and
                                             its outcome counts (JSON; written by run_sweep)
    leasekeeper:<queue>:sweep:<name>:running when the tick that holds the sweep's lock
                                             started; gone when it ends, and expiring with
                                             the lock (LEASEKEEPER_SWEEP_LOCK_TTL_S)

Writes are best effort: a Redis hiccup never fails a tick. Every key expires, so an
installation that is gone leaves nothing behind for long.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, cast

import redis

KEY_TTL_S = 7 * 24 * 3600


def beat_key(queue: str) -> str:
    return f"leasekeeper:{queue}:beat"


def sweep_key(queue: str, sweep: str) -> str:
    return f"leasekeeper:{queue}:sweep:{sweep}:last"


def mark_beat(client: redis.Redis[bytes], queue: str, ttl_s: float,
              started: float | None = None) -> str:
    """Mark beat's tick now; returns the mark's value (for ``unmark_beat``)."""
    now = time.time()
    with contextlib.suppress(redis.RedisError):
        client.set(beat_key(queue), repr(now), ex=max(int(ttl_s), 1))
        # A process's first tick says when it started; a later one restores the mark if
        # Redis lost it (a restart without persistence lost every sweep's tick too), so
        # sweeps get their grace from then, not a false "has not run" at once.
        client.set(beat_key(queue) + ":started", repr(now if started is None else started),
                   ex=KEY_TTL_S, nx=started is None)
    return repr(now)


# Delete the key only while it holds this value: one beat's stop leaves another's mark alone.
_DELETE_IF = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
              "return redis.call('del', KEYS[1]) end return 0")


def unmark_beat(client: redis.Redis[bytes], queue: str, mark: str) -> None:
    """A beat stopping cleanly: its mark (``mark``, what ``mark_beat`` returned) goes,
    unless a later tick of another beat replaced it."""
    with contextlib.suppress(redis.RedisError):
        cast(Any, client).eval(_DELETE_IF, 1, beat_key(queue), mark)  # untyped in redis-py


def last_beat(client: redis.Redis[bytes], queue: str) -> float | None:
    raw = client.get(beat_key(queue))
    return float(raw) if raw else None


def beat_started(client: redis.Redis[bytes], queue: str) -> float | None:
    raw = client.get(beat_key(queue) + ":started")
    return float(raw) if raw else None


def running_key(queue: str, sweep: str) -> str:
    return f"leasekeeper:{queue}:sweep:{sweep}:running"


def mark_sweep_running(client: redis.Redis[bytes], queue: str, sweep: str,
                       lock_ttl_s: float) -> None:
    """A tick started (and holds the lock): status counts the sweep as running, not late,
    however long the tick takes, until it ends or its lock expires."""
    with contextlib.suppress(redis.RedisError):
        client.set(running_key(queue, sweep), repr(time.time()), ex=max(int(lock_ttl_s), 1))


def unmark_sweep_running(client: redis.Redis[bytes], queue: str, sweep: str) -> None:
    with contextlib.suppress(redis.RedisError):
        client.delete(running_key(queue, sweep))


def running_sweeps(client: redis.Redis[bytes], queue: str, sweeps: list[str]
                   ) -> dict[str, float | None]:
    """When each sweep's running tick started (None: none is running)."""
    raws = client.mget([running_key(queue, name) for name in sweeps])
    return {name: (float(raw) if raw else None) for name, raw in zip(sweeps, raws, strict=True)}


def mark_sweep(client: redis.Redis[bytes], queue: str, summary: dict[str, Any]) -> None:
    tick = {k: v for k, v in summary.items() if k != "items"} | {"at": time.time()}
    with contextlib.suppress(redis.RedisError):
        client.set(sweep_key(queue, str(summary["sweep"])), json.dumps(tick), ex=KEY_TTL_S)


def failed_key(queue: str, sweep: str) -> str:
    return f"leasekeeper:{queue}:sweep:{sweep}:failed"


def mark_sweep_failed(client: redis.Redis[bytes], queue: str, sweep: str, error: str) -> None:
    """A tick that raised: when, and why (bounded), for `leasekeeper status` to say."""
    failure = {"at": time.time(), "error": error[:300]}
    with contextlib.suppress(redis.RedisError):
        client.set(failed_key(queue, sweep), json.dumps(failure), ex=KEY_TTL_S)


def _marks(client: redis.Redis[bytes], keys: dict[str, str]
           ) -> dict[str, dict[str, Any] | None]:
    """Each name's JSON mark at its key (None where there is none), in one MGET."""
    raws = client.mget(list(keys.values()))
    return {name: (json.loads(raw) if raw else None) for name, raw in zip(keys, raws,
                                                                         strict=True)}


def last_failures(client: redis.Redis[bytes], queue: str, sweeps: list[str]
                  ) -> dict[str, dict[str, Any] | None]:
    return _marks(client, {name: failed_key(queue, name) for name in sweeps})


def last_sweeps(client: redis.Redis[bytes], queue: str, sweeps: list[str]
                ) -> dict[str, dict[str, Any] | None]:
    return _marks(client, {name: sweep_key(queue, name) for name in sweeps})
