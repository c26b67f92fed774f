"""The celery beat schedule (one entry per sweep, intervals from settings), and the
scheduler that marks beat alive in Redis on every tick (read by `leasekeeper health --beat`).
"""

from __future__ import annotations

import time
from typing import Any

from celery.beat import PersistentScheduler

from workers.settings import Settings, get_settings

STALE_INTERVALS = 3  # a sweep (or beat) whose last tick is older than this many intervals is late

SWEEPS = {
    "sweep.reap_runs": "reap_runs_interval_s",
    "sweep.expire_leases": "expire_leases_interval_s",
    "sweep.retry_cleanup": "retry_cleanup_interval_s",
    "sweep.finish_exited": "finish_exited_interval_s",
    "sweep.stuck_provisioning": "stuck_provisioning_interval_s",
    "sweep.orphans": "orphans_interval_s",
    "sweep.fill_pools": "fill_pools_interval_s",
}


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {}
    for task, interval_field in SWEEPS.items():
        interval_s = float(getattr(settings, interval_field))
        schedule[task] = {
            "task": task,
            "schedule": interval_s,
            # A tick that waited longer than its interval is stale: the next one will come.
            "options": {"expires": interval_s},
        }
    return schedule


class HeartbeatScheduler(PersistentScheduler):  # type: ignore[misc]
    """Celery's persistent scheduler that also writes ``leasekeeper:<queue>:beat`` (see
    workers/heartbeats.py) at most once a second; the mark expires after three of beat's
    longest sleeps, so a dead beat shows as dead."""

    _marked_at = 0.0
    _client: Any = None
    _mark: str | None = None  # the value of this process's last mark

    def tick(self, *args: Any, **kwargs: Any) -> float:
        sleep_s: float = super().tick(*args, **kwargs)
        now = time.monotonic()
        if now - self._marked_at >= 1.0:
            from workers.heartbeats import mark_beat

            settings = get_settings()
            if self._client is None:
                self._client = _redis(settings)
            self._mark = mark_beat(self._client, settings.task_queue,
                                   3 * max(self.max_interval, sleep_s, 1.0),
                                   started=None if self._marked_at else time.time())
            self._marked_at = now
        return sleep_s

    def close(self) -> None:
        """Beat's clean shutdown (SIGTERM, SIGINT: celery's Service.stop syncs, then closes
        the scheduler): its mark goes, so nothing takes a stopped beat for a running one
        (`db downgrade` refuses while beat runs). Only its own mark: another beat's
        newer one stays."""
        try:
            super().close()
        finally:
            if self._client is not None and self._mark is not None:
                from workers.heartbeats import unmark_beat

                unmark_beat(self._client, get_settings().task_queue, self._mark)
                self._mark = None


def beat_stale_after_s(settings: Settings) -> float:
    """A beat mark older than this is a beat that is gone (`health --beat`, `db
    downgrade`): three of its longest sleeps."""
    return STALE_INTERVALS * beat_max_interval_s(settings)


def beat_max_interval_s(settings: Settings) -> float:
    """Beat never sleeps longer than its shortest sweep interval (nor 60 s), so its mark
    stays fresh."""
    return min(60.0, *(float(getattr(settings, f)) for f in SWEEPS.values()))


def _redis(settings: Settings) -> Any:
    import redis

    return redis.Redis.from_url(settings.effective_broker_url, socket_timeout=5,
                                socket_connect_timeout=5)
