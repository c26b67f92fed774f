"""What the task events (Flower), ``celery inspect`` and the worker's log show of a task's
arguments, through real workers on real Redis and SQLite, watched by an event receiver
as Flower is:

- ``run.finish``'s error, which may quote any secret of the run, is never shown: only its
  length (the stored error is scrubbed by the secret marks and stays readable), on a
  worker that never saw the run's acquire, however the finish is sent (the producer API,
  or by name from a client with only ``celery``, which sends the full repr);
- a ``secret_env`` value repeated elsewhere in an acquire's payload (an ``env`` value, a
  command argument) shows nowhere: events, log, the stored lease spec.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.e2e.conftest import eventually
from tests.e2e.test_secret_marks import acquire, all_acked
from tests.services import RedisServer
from tests.stack import WorkerStack, sending_to
from workers.app import app

pytestmark = pytest.mark.timeout(300)
CORE = uuid.uuid4().hex
SECRET = f"tok-{CORE}"


class EventLog:
    """Every event of the broker's event exchange, as Flower receives them."""

    def __init__(self, broker_url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self._connection = app.connection_for_read(broker_url)
        self._receiver = app.events.Receiver(self._connection, handlers={"*": self.events.append})
        self._thread = threading.Thread(target=self._receiver.capture,
                                        kwargs={"limit": None, "timeout": None}, daemon=True)
        self._thread.start()

    def of(self, task_id: str, kind: str) -> dict[str, Any]:
        return eventually(lambda: next((e for e in list(self.events) if e.get("uuid") == task_id
                                        and e["type"] == kind), None), 60,
                          f"the {kind} event of task {task_id}")

    def listening(self) -> None:
        """Wait for a worker's event: the receiver's queue is bound (events sent before
        that are lost to it, as to Flower)."""
        eventually(lambda: any(e["type"].startswith("worker-") for e in list(self.events)),
                   60, "a worker's event")

    def stop(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(10)
        self._connection.release()


@pytest.fixture
def stack(redis_server: RedisServer, tmp_path: Path) -> Iterator[WorkerStack]:
    from models.migrate import upgrade

    name = f"reprs-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=name, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": name,
                                   "LEASEKEEPER_INSTALLATION_ID": name})
    with sending_to(name):
        try:
            yield stack
        finally:
            stack.stop()


@pytest.fixture
def events(redis_server: RedisServer) -> Iterator[EventLog]:
    log = EventLog(redis_server.url)
    try:
        yield log
    finally:
        log.stop()


def plain_client(broker_url: str, queue: str) -> Celery:
    """A web backend with only ``celery``: it sends the full repr of the arguments."""
    client = Celery(broker=broker_url, backend=broker_url)
    client.conf.task_default_queue = queue
    return client


def scheduled_with(task_id: str) -> str | None:
    """``celery inspect scheduled`` as JSON, once it lists ``task_id``."""
    answer = json.dumps(app.control.inspect(timeout=2).scheduled())
    return answer if task_id in answer else None


def test_a_finish_error_shows_only_its_length_on_a_worker_that_never_saw_the_secret(
        stack: WorkerStack, events: EventLog, redis_server: RedisServer) -> None:
    from tasks.producer import finish_run

    rt = stack.runtime()
    first = stack.start_worker(concurrency=1)
    events.listening()
    run_a, run_b = f"run-a-{uuid.uuid4().hex[:8]}", f"run-b-{uuid.uuid4().hex[:8]}"
    acquire(run_a, secret_env={"API_TOKEN": SECRET})
    acquire(run_b, secret_env={"API_TOKEN": SECRET})
    all_acked(stack, redis_server)
    stack.kill_worker(first)  # the only process that saw the secret
    stack.start_worker(concurrency=1)
    error = f"401 from api: Authorization: Bearer {SECRET} refused"

    by_producer = finish_run(run_a, "failed", 1, error)  # the producer API
    by_producer.get(90)
    client = plain_client(redis_server.url, stack.name)
    by_name_raw = client.send_task("run.finish", kwargs={
        "run_id": run_b, "status": "failed", "exit_code": 1, "error": error})
    by_name_raw.get(90)
    # one waiting for its countdown, as `celery inspect scheduled` (and Flower) see it
    waiting = client.send_task("run.finish", countdown=3600, kwargs={
        "run_id": run_b, "status": "failed", "exit_code": 1, "error": error})
    scheduled = eventually(lambda: scheduled_with(waiting.id), 60,
                           "the finish waiting for its countdown")
    app.control.revoke(waiting.id)

    shown = f"'error': '<error: {len(error)} chars>'"
    assert shown in events.of(by_producer.id, "task-sent")["kwargs"]
    for task_id in (by_producer.id, by_name_raw.id, waiting.id):
        assert shown in events.of(task_id, "task-received")["kwargs"]
    assert shown in scheduled and CORE not in scheduled
    assert not [e for e in events.events if CORE in json.dumps(e)]
    log = stack.logfile.read_text(errors="replace")
    assert f"Task run.finish[{by_name_raw.id}] received" in log and CORE not in log
    for run_id in (run_a, run_b):  # the operator still reads the error, scrubbed
        stored = rt.store.get_run(run_id)
        assert stored is not None
        assert stored.error == "401 from api: Authorization: Bearer *** refused"


def test_a_destroy_reason_shows_only_its_length_and_is_stored_scrubbed_anywhere(
        stack: WorkerStack, events: EventLog, redis_server: RedisServer) -> None:
    # Before (a QA pass): a reason quoting a run's secret showed in Flower for every
    # destroy, and was stored and shown in clear (`leases show`, `runs show`, the console)
    # whenever the destroy ran in another process than the run's acquire.
    from tasks.producer import destroy_lease

    rt = stack.runtime()
    first = stack.start_worker(concurrency=1)
    events.listening()
    run_a, run_b = f"run-a-{uuid.uuid4().hex[:8]}", f"run-b-{uuid.uuid4().hex[:8]}"
    lease_a = acquire(run_a, secret_env={"API_TOKEN": SECRET})
    lease_b = acquire(run_b, thread_id=f"th-{CORE[:6]}", reuse=True,
                      secret_env={"API_TOKEN": SECRET})
    all_acked(stack, redis_server)
    stack.kill_worker(first)  # the only process that saw the secret
    stack.start_worker(concurrency=1)
    reason = f"user cancelled; token {SECRET} revoked"

    by_producer = destroy_lease(lease_a, reason)
    by_producer.get(90)
    client = plain_client(redis_server.url, stack.name)  # sends the full repr
    by_name_raw = client.send_task("lease.destroy",
                                   kwargs={"lease_id": lease_b, "reason": reason})
    by_name_raw.get(90)
    positional = client.send_task("lease.destroy", args=[lease_b, reason])
    with pytest.raises(Exception, match="keyword arguments only"):
        positional.get(90)  # refused, and its repr hid the reason all the same

    shown = f"<reason: {len(reason)} chars>"
    assert shown in events.of(by_producer.id, "task-sent")["kwargs"]
    for task_id in (by_producer.id, by_name_raw.id):
        assert shown in events.of(task_id, "task-received")["kwargs"]
    assert shown in events.of(positional.id, "task-received")["args"]
    assert not [e for e in events.events if CORE in json.dumps(e)]
    assert CORE not in stack.logfile.read_text(errors="replace")
    for lease_id, run_id in ((lease_a, run_a), (lease_b, run_b)):
        lease = rt.store.get_lease(lease_id)
        assert lease.state == "destroyed" and lease.end_reason is not None
        assert "***" in lease.end_reason and CORE not in lease.end_reason
        assert not [e.reason for e in rt.store.events(lease_id) if CORE in (e.reason or "")]
        run = rt.store.get_run(run_id)
        assert run is not None and CORE not in (run.error or "")


def test_a_secret_repeated_elsewhere_in_an_acquire_shows_nowhere(
        stack: WorkerStack, events: EventLog, redis_server: RedisServer) -> None:
    rt = stack.runtime()
    stack.start_worker(concurrency=1)
    events.listening()
    short = uuid.uuid4().hex[:4]  # too short to look for inside text: hidden when whole
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    client = plain_client(redis_server.url, stack.name)
    sent = client.send_task("lease.acquire", kwargs={"run_id": run_id, "spec": {
        "provider": "noop", "secret_env": {"API_TOKEN": SECRET, "PIN": short},
        "env": {"COPY": SECRET, "PIN_COPY": short, "VISIBLE": "shown"},
        "command": ["sh", "-c", f"curl -H 'Bearer {SECRET}' https://api"]}})
    # the acquire is refused (env and a command are sent in clear), naming where, never
    # the value; before that, the worker's reprs of it hid every copy
    with pytest.raises(Exception, match=r"env 'COPY': holds a secret_env") as err:
        sent.get(90)
    assert SECRET not in str(err.value) and short not in str(err.value)
    received = events.of(sent.id, "task-received")["kwargs"]
    assert "'VISIBLE': 'shown'" in received and "'COPY': '***'" in received
    assert "'PIN_COPY': '***'" in received and "Bearer ***" in received
    assert short not in received
    assert rt.store.get_run(run_id) is None  # refused before anything was written
    all_acked(stack, redis_server)
    assert not [e for e in events.events if CORE in json.dumps(e)]
    assert CORE not in stack.logfile.read_text(errors="replace")
