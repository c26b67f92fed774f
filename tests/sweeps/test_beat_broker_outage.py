"""Beat through a Redis outage, against a real Redis stopped and started again on its port.

Before: beat logged, for each tick while Redis was away, CRITICAL "Retry limit exceeded while
trying to reconnect to the Celery result store backend. The Celery application must be
restarted." (Celery's Redis result backend subscribes a sender to each task's result; beat
never reads one), and an operator restarted a beat that needed nothing (a QA pass)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from models.migrate import upgrade
from tests.e2e.conftest import eventually
from tests.services import free_port, start_redis
from tests.stack import WorkerStack
from tests.sweeps.beats import beats

pytestmark = pytest.mark.timeout(180)


def test_beat_rides_out_a_broker_outage_without_a_critical_line(tmp_path: Path) -> None:
    port = free_port()
    broker = start_redis(tmp_path / "redis", port)
    try:
        store_url = f"sqlite:///{tmp_path / 'store.db'}"
        upgrade(store_url)
        queue = f"outage-{uuid.uuid4().hex[:8]}"
        stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                            broker_url=broker.url, extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
        with beats(stack.env, tmp_path, 1, 0.5, "outage") as (log,):
            sent = "Scheduler: Sending due task sweep."
            eventually(lambda: log.read_text().count(sent) >= 7, 60, "beat's first ticks")
            # when Redis goes away for a while, then comes back
            broker.stop()
            time.sleep(10)
            broker = start_redis(tmp_path / "redis", port)
            before = log.read_text().count(sent)
            # then beat goes on sending the sweeps
            eventually(lambda: log.read_text().count(sent) >= before + 7, 60,
                       "beat's ticks after the outage")
            said = log.read_text()
            # and said nothing it need not: no CRITICAL, no call to restart it
            assert "CRITICAL" not in said and "must be restarted" not in said, said[-3000:]
    finally:
        broker.stop()
