"""A worker outlives its broker's restart.

Redis restarts (an upgrade, a failover, an OOM kill) while a worker holds messages it has
not acknowledged yet (``acks_late``: every task in flight). The worker must reconnect and go
on, and the work it held must still be done: a worker that exits instead leaves its queues
unconsumed until something restarts it. (Celery 5.7.0 closes the lost connection a second
time after collecting it; kombu's Redis channel then restores its unacknowledged messages
through a transport that collect already detached, an ``AttributeError`` Celery treats as
unrecoverable: the worker exited on every broker restart that found a task in flight.)
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis as redis_client

from models.migrate import upgrade
from models.schema import LeaseState
from models.store import Store
from tests.e2e.conftest import eventually
from tests.services import free_port, start_redis
from tests.stack import WorkerStack
from workers.app import create_app

pytestmark = pytest.mark.timeout(180)


def test_a_worker_holding_unacknowledged_tasks_survives_a_broker_restart(
        tmp_path: Path) -> None:
    port = free_port()
    broker = start_redis(tmp_path / "redis", port)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=f"restart-{uuid.uuid4().hex[:6]}", store_url=store_url,
                        root=tmp_path, broker_url=broker.url)
    client = create_app(stack.settings())
    client.conf.broker_connection_retry_on_startup = True
    try:
        worker = stack.spawn_worker(concurrency=3)
        stack.await_worker(worker, client)
        # Both pool processes busy in a slow provider call: the worker holds two
        # unacknowledged messages when the broker goes away.
        stack.faults.write({"acquire": [{"fault": "slow", "seconds": 3, "times": 2}]})
        runs = [f"run-{uuid.uuid4().hex[:10]}" for _ in range(2)]
        for run_id in runs:
            client.send_task("lease.acquire", kwargs={"run_id": run_id,
                                                      "spec": {"provider": "faulty"}})
        held = redis_client.Redis(port=port)
        store = stack.runtime().store
        try:
            eventually(lambda: held.hlen("unacked") >= 2, 60, "the worker to take both tasks")
            eventually(lambda: len([lease for lease in store.leases()
                                    if lease.run_id in runs]) == 2,
                       60, "both acquires to write their intent and call the provider")
        except AssertionError as waited:  # a busy CI host: say what the worker did
            raise AssertionError(f"{waited}; leases {store.leases()}; worker log:\n"
                                 f"{_tail(stack.logfile)}") from None
        finally:
            held.close()

        broker.stop()
        time.sleep(2)
        broker = start_redis(tmp_path / "redis", port)

        stack.await_worker(worker, client)
        # It consumes again: a run acquired after the restart gets its sandbox.
        after = f"run-{uuid.uuid4().hex[:10]}"
        client.send_task("lease.acquire", kwargs={"run_id": after, "spec": {}})
        eventually(lambda: _active(store, after), 60, "an acquire sent after the restart")
        # The two it held are not lost track of: the intent each wrote before the provider
        # call is in the store, for the sweeps to finish or undo (this broker kept nothing
        # over its restart, so no message comes back).
        held_leases = {lease.run_id: lease.state for lease in store.leases()
                       if lease.run_id in runs}
        assert sorted(held_leases) == sorted(runs), held_leases
        assert "Unrecoverable error" not in stack.logfile.read_text(), _tail(stack.logfile)
        assert worker.poll() is None, _tail(stack.logfile)
    finally:
        stack.stop()
        broker.stop()
        client.close()


def _active(store: Store, run_id: str) -> bool:
    return any(lease.state == LeaseState.ACTIVE for lease in store.leases()
               if lease.run_id == run_id)


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
