"""A broker that is up but full: Redis at maxmemory with maxmemory-policy noeviction.

Such a Redis answers PING and reads, and refuses every write that may grow it ("OOM
command not allowed when used memory > 'maxmemory'"). The producer and `leasekeeper
status`/`health` must name that, not an unreachable broker; a worker must outlive it as it
outlives a lost connection, and the task it had popped when its bookkeeping write was
refused must not vanish: it runs once Redis takes writes again.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis as redis_client

from models.migrate import upgrade
from models.schema import LeaseState
from models.store import Store
from tests.e2e.conftest import cli_env, eventually, leasekeeper
from tests.services import start_redis
from tests.stack import WorkerStack
from workers.app import create_app
from workers.queues import POLL_ORDER, queue_name

FULL = "is out of memory (used memory > maxmemory)"
FIX = "raise its maxmemory or free memory (leasekeeper needs maxmemory-policy noeviction)"


def fill(client: redis_client.Redis[bytes]) -> None:
    """A small maxmemory, below what this Redis already uses: every write is refused."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used // 2))


_PROBE = (
    "from tasks import producer\n"
    "from providers.errors import BrokerUnavailable\n"
    "try:\n"
    "    producer.acquire_lease('run-1', {'tenant': 'acme'})\n"
    "except BrokerUnavailable as exc:\n"
    "    print('unavailable', exc)\n"
)


@pytest.mark.timeout(120)
def test_a_full_broker_is_named_full_by_the_producer_status_and_health(
        tmp_path: Path) -> None:
    broker = start_redis(tmp_path / "redis")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    client: redis_client.Redis[bytes] = redis_client.Redis.from_url(broker.url)
    env = cli_env(LEASEKEEPER_BROKER_URL=broker.url, LEASEKEEPER_STORE_URL=store_url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    try:
        fill(client)
        # Before: "the broker at redis://... (LEASEKEEPER_BROKER_URL) is unreachable (command
        # not allowed when used memory > 'maxmemory'); nothing was sent. Start Redis there
        # or fix the URL, then retry."
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                              text=True, env=env, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        said = done.stdout
        assert said.startswith("unavailable "), done.stdout + done.stderr
        assert f"the broker's Redis at {broker.url} {FULL}; nothing was sent: {FIX}, " \
               "then retry" in said, said
        assert "unreachable" not in said and "Start Redis" not in said, said
        # Before: health said nothing (PING answers) and status listed the queues.
        for command in (["health", "--broker"], ["status"]):
            done = leasekeeper(*command, env=env)
            said = done.stdout + done.stderr
            assert done.returncode == 1, said
            assert f"the broker's Redis at {broker.url} {FULL}" in said and FIX in said, said
            assert "unreachable" not in said and "Traceback" not in said, said
    finally:
        client.close()
        broker.stop()


@pytest.mark.timeout(300)
def test_a_worker_outlives_a_full_broker_and_runs_the_task_it_had_taken(
        tmp_path: Path) -> None:
    broker = start_redis(tmp_path / "redis")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=f"full-{uuid.uuid4().hex[:6]}", store_url=store_url,
                        root=tmp_path, broker_url=broker.url)
    app = create_app(stack.settings())
    client: redis_client.Redis[bytes] = redis_client.Redis.from_url(broker.url)
    queue = stack.settings().task_queue
    try:
        # The message, as the producer sends it, taken out of its queue to send again later.
        taken = f"run-{uuid.uuid4().hex[:10]}"
        app.send_task("lease.acquire", kwargs={"run_id": taken, "spec": {}})
        key, raw = next((k, m) for k in (queue_name(queue, lane) for lane in POLL_ORDER)
                        if (m := client.rpop(k)) is not None)
        worker = stack.await_worker(stack.spawn_worker(), app)
        store = stack.runtime().store
        # Redis accepts one more write, which takes it past maxmemory: the message arrives
        # with a filler, in one transaction, and the idle worker pops it from a full Redis.
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", str(int(client.info("memory")["used_memory"])
                                           + 256 * 1024))
        pipe = client.pipeline(transaction=True)
        pipe.setrange("filler", 2 * 1024 * 1024, "x")  # 2 MB made by Redis, a short command
        pipe.rpush(key, raw)
        pipe.execute()

        # Before: "Unrecoverable error: OutOfMemoryError ... Command # 1 (ZADD
        # unacked_index ...)", the worker exited, and the task was in no queue and not in
        # `unacked`.
        try:
            eventually(lambda: FULL in stack.logfile.read_text(errors="replace"), 60,
                       "the worker to meet the full broker")
        except AssertionError as waited:  # say what the worker did instead
            raise AssertionError(f"{waited}; worker log:\n{_tail(stack.logfile)}") from None
        # Still full: the worker keeps the task, tries to hand it back, and waits again.
        eventually(lambda: stack.logfile.read_text(errors="replace").count(
            "(next try in") >= 3, 60, "the worker to try again while the broker is full")
        assert worker.poll() is None, _tail(stack.logfile)
        assert not _active(store, taken)
        client.config_set("maxmemory", "0")  # memory freed

        eventually(lambda: _active(store, taken), 90, "the task taken from the full broker")
        stack.await_worker(worker, app)
        log = stack.logfile.read_text(errors="replace")
        assert "Unrecoverable error" not in log, _tail(stack.logfile)
        assert worker.poll() is None, _tail(stack.logfile)
    finally:
        stack.stop()
        client.close()
        broker.stop()
        app.close()


def _active(store: Store, run_id: str) -> bool:
    return any(lease.state == LeaseState.ACTIVE for lease in store.leases()
               if lease.run_id == run_id)


def _tail(path: Path, lines: int = 80) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
