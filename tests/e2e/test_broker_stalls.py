"""A broker that stops answering: calls fail within bounded socket timeouts, never hang.

A frozen Redis (SIGSTOPped, a dead NAT path, a failover that left the connection open)
accepts TCP and never replies. Celery's result backend waits 120 s for a reply by default
and kombu's transport forever; the producer must raise BrokerUnavailable in seconds. The
same timeouts must leave an idle worker alone: its BRPOP returns every second, far inside
them, so a quiet queue is never mistaken for a dead broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.migrate import upgrade
from models.schema import LeaseState
from tests.e2e.conftest import cli_env, eventually
from tests.services import start_redis
from tests.stack import WorkerStack
from workers.app import BROKER_SOCKET_TIMEOUT_S, create_app


@contextlib.contextmanager
def never_answering_server() -> Iterator[int]:
    """A port that accepts connections, reads nothing and never replies (a frozen Redis)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        thread.join(5)
        for conn in held:
            conn.close()


_PROBE = (
    "from tasks import producer\n"
    "from providers.errors import BrokerUnavailable\n"
    "try:\n"
    "    producer.acquire_lease('run-1', {'tenant': 'acme'})\n"
    "except BrokerUnavailable as exc:\n"
    "    print('unavailable', exc)\n"
)


@pytest.mark.timeout(40)
def test_a_producer_call_to_a_broker_that_never_answers_raises_broker_unavailable(
        tmp_path: Path) -> None:
    # Before: it raised only after Celery's 120 s redis_socket_timeout.
    with never_answering_server() as port:
        url = f"redis://:secret-pw@127.0.0.1:{port}/0"
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              env=cli_env(LEASEKEEPER_BROKER_URL=url,
                                          LEASEKEEPER_VAR_DIR=str(tmp_path)), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("unavailable "), done.stdout + done.stderr
    assert f"127.0.0.1:{port}" in done.stdout and "LEASEKEEPER_BROKER_URL" in done.stdout
    assert "secret-pw" not in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(40)
def test_a_send_right_after_the_broker_froze_raises_broker_unavailable(tmp_path: Path
                                                                       ) -> None:
    # A send within a second of one that reached the broker skips the PING: the publish
    # itself meets the frozen broker. Before: Celery retried it four times, each waiting
    # out the read timeout (50 s); without timeouts, it never returned.
    broker = start_redis(tmp_path / "redis")
    probe = (
        "import os, signal\n"
        "from tasks import producer\n"
        "from providers.errors import BrokerUnavailable\n"
        "producer.acquire_lease('run-1', {'tenant': 'acme'})\n"
        "os.kill(int(os.environ['REDIS_PID']), signal.SIGSTOP)\n"
        "try:\n"
        "    producer.destroy_lease('0123456789abcdef')\n"
        "except BrokerUnavailable as exc:\n"
        "    print('unavailable', exc)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env=cli_env(LEASEKEEPER_BROKER_URL=broker.url,
                                          LEASEKEEPER_VAR_DIR=str(tmp_path),
                                          REDIS_PID=str(broker.proc.pid)), check=False)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
        broker.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("unavailable "), done.stdout + done.stderr
    assert broker.url in done.stdout and "LEASEKEEPER_BROKER_URL" in done.stdout
    assert "Traceback" not in done.stderr


IDLE_S = max(16.0, BROKER_SOCKET_TIMEOUT_S + 6)  # longer than any socket timeout


@pytest.mark.timeout(120)
def test_an_idle_worker_outlives_the_socket_timeouts_and_still_consumes(
        tmp_path: Path) -> None:
    broker = start_redis(tmp_path / "redis")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=f"idle-{uuid.uuid4().hex[:6]}", store_url=store_url,
                        root=tmp_path, broker_url=broker.url)
    client = create_app(stack.settings())
    try:
        worker = stack.await_worker(stack.spawn_worker(), client)
        # No message for longer than the read timeout: the worker's BRPOP, its pidbox and
        # the events connection all sit idle. Then it still answers a ping...
        time.sleep(IDLE_S)
        stack.await_worker(worker, client)
        # ...and consumes a task that takes longer than the read timeout, whose result the
        # producer waits for.
        stack.faults.write({"acquire": [{"fault": "slow", "seconds": IDLE_S, "times": 1}]})
        run_id = f"run-{uuid.uuid4().hex[:10]}"
        result = client.send_task("lease.acquire", kwargs={"run_id": run_id,
                                                           "spec": {"provider": "faulty"}})
        answer = result.get(timeout=60)
        assert answer["result"] == "acquired", answer
        store = stack.runtime().store
        eventually(lambda: any(lease.run_id == run_id and lease.state == LeaseState.ACTIVE
                               for lease in store.leases()), 10, "the lease to be active")
        log = stack.logfile.read_text()
        assert "Connection to broker lost" not in log, log[-3000:]
        assert "Timeout" not in log, log[-3000:]
        assert worker.poll() is None, log[-3000:]
    finally:
        stack.stop()
        broker.stop()
        client.close()
