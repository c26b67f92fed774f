"""``leasekeeper.ping``: a task that does nothing, for health checks and benchmark baselines."""

from __future__ import annotations

from tasks.base import LeaseTask
from workers.app import app


@app.task(bind=True, base=LeaseTask, name="leasekeeper.ping")
def ping(self: LeaseTask) -> str:
    return "pong"
