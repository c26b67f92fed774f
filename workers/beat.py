"""The celery beat schedule: one entry per sweep, intervals from settings."""

from __future__ import annotations

from typing import Any

from workers.settings import Settings

SWEEPS = {
    "sweep.reap_runs": "reap_runs_interval_s",
    "sweep.expire_leases": "expire_leases_interval_s",
    "sweep.retry_cleanup": "retry_cleanup_interval_s",
    "sweep.finish_exited": "finish_exited_interval_s",
    "sweep.stuck_provisioning": "stuck_provisioning_interval_s",
    "sweep.orphans": "orphans_interval_s",
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
