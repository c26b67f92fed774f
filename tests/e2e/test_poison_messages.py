"""Malformed task messages, published with kombu as a non-Python web backend would (by
name, raw JSON, protocol 2, on ``<queue>.acquire``), to a real worker on real Redis.

None may stop the worker (a poison message restored to the queue killed every restart):
each is taken off the queue; one with a task id (headers ``id``) gets a stored FAILURE,
an ``InvalidRequest`` saying what was wrong and what shape is expected, so ``.get()``
raises it instead of waiting on PENDING for ever; one without is logged by its size. No
body's content shows in the worker's log or in the error (a body may carry a secret).
"""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from providers.errors import InvalidRequest
from tasks import producer
from tests.e2e.conftest import eventually
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)

JSON = ("application/json", "utf-8")


def marker() -> str:
    return f"kombu-s3cret-VALUE-{uuid.uuid4().hex}"


@dataclass
class Poison:
    body: str | bytes
    content: tuple[str, str] = JSON
    mentions: tuple[str, ...] = ()  # what the InvalidRequest must say
    headers: dict[str, Any] = field(default_factory=dict)  # replacing the usual ones


# Each case built around a fresh marker, text a log or an error must never show.
CASES: dict[str, Callable[[str], Poison]] = {
    "object": lambda m: Poison(json.dumps({"run_id": "kb-3", "spec": {"note": m}}),
                               mentions=("JSON object", "[args, kwargs, embed]")),
    "two_elements": lambda m: Poison(json.dumps([[], {"run_id": "kb-6", "note": m}]),
                                     mentions=("2 elements", "[args, kwargs, embed]")),
    "string": lambda m: Poison(json.dumps(f"hello {m}"),
                               mentions=("JSON string", "[args, kwargs, embed]")),
    "three_chars": lambda m: Poison(json.dumps("abc"), mentions=("JSON string",)),
    "kwargs_list": lambda m: Poison(json.dumps([[], ["kb-4", m], {}]),
                                    mentions=("kwargs", "JSON array", "object")),
    "args_object": lambda m: Poison(json.dumps([{"run_id": m}, {}, {}]),
                                    mentions=("args", "JSON object", "array")),
    "embed_string": lambda m: Poison(json.dumps([[], {"run_id": "kb-9"}, m]),
                                     mentions=("embed", "JSON string")),
    "malformed_json": lambda m: Poison('[[], {"run_id": "kb-5", "note": "' + m,
                                       mentions=("not valid JSON",)),
    "pickle": lambda m: Poison(pickle.dumps([[], {"run_id": m}, {}]),
                               ("application/x-python-serialize", "binary"),
                               mentions=("application/x-python-serialize", "JSON")),
    "not_utf8": lambda m: Poison(b"\xff\xfe" + m.encode(), ("application/json", "utf-8"),
                                 mentions=("utf-8",)),
    "task_name_list": lambda m: Poison(json.dumps([[], {"run_id": m}, {}]),
                                       mentions=("task name",),
                                       headers={"task": ["lease.acquire"]}),
    "timelimit": lambda m: Poison(json.dumps([[], {"run_id": m}, {}]),
                                  mentions=("timelimit",), headers={"timelimit": "soon"}),
}
# Well formed but for its missing task id (Celery's request raised KeyError('id')).
NO_ID = {**CASES, "well_formed": lambda m: Poison(json.dumps([[], {"run_id": m}, {}]))}


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[WorkerStack]:
    with own_queue_stack("poison", redis_server.url, tmp_path_factory.mktemp("poison")) as s:
        yield s


def publish(stack: WorkerStack, poison: Poison, task_id: str | None, probe: str) -> int:
    """Publish ``poison`` as the tester did; returns the body's size in bytes."""
    headers: dict[str, Any] = {"lang": "js", "task": "lease.acquire", "x-probe": probe}
    if task_id is not None:
        headers["id"] = task_id
    headers.update(poison.headers)
    content_type, encoding = poison.content
    with Connection(stack.broker_url) as conn:
        conn.Producer().publish(poison.body, exchange="", routing_key=queue(stack),
                                headers=headers, content_type=content_type,
                                content_encoding=encoding)
    return len(poison.body if isinstance(poison.body, bytes) else poison.body.encode())


def queue(stack: WorkerStack) -> str:
    return f"{stack.extra_env['LEASEKEEPER_TASK_QUEUE']}.acquire"


def still_queued(stack: WorkerStack, probe: str) -> bool:
    """The message is still in its queue, or held unacknowledged by a worker."""
    r = redis.Redis.from_url(stack.broker_url)
    held = [*r.lrange(queue(stack), 0, -1), *r.hvals("unacked")]
    return any(probe.encode() in item for item in held)


def worker_log(stack: WorkerStack) -> str:
    return "\n".join(p.read_text(errors="replace") for p in Path(stack.root).rglob("*.log*")
                     if p.is_file())


def worker_gone(stack: WorkerStack) -> bool:
    return any(proc.poll() is not None for proc in stack.procs)


def assert_the_worker_serves(stack: WorkerStack) -> None:
    assert not worker_gone(stack), f"the worker exited; see {stack.logfile}"
    assert app.send_task("leasekeeper.ping").get(timeout=60) == "pong"


@pytest.mark.parametrize("tag", list(CASES))
def test_a_malformed_message_with_a_task_id_fails_its_task_and_the_worker_goes_on(
        stack: WorkerStack, tag: str) -> None:
    mark = marker()
    poison = CASES[tag](mark)
    task_id, probe = str(uuid.uuid4()), uuid.uuid4().hex
    publish(stack, poison, task_id, probe)

    result = app.AsyncResult(task_id)
    eventually(lambda: result.ready() or worker_gone(stack), 60, "the task's result")
    assert not worker_gone(stack), f"the worker exited; see {stack.logfile}"
    with pytest.raises(InvalidRequest) as refused:
        result.get(timeout=10)
    message = str(refused.value)
    for mention in poison.mentions:
        assert mention in message, message
    assert "kb-" not in message and mark not in message, message
    assert len(message) <= 400, message
    eventually(lambda: not still_queued(stack, probe), 30, "the message taken off the queue")
    assert_the_worker_serves(stack)
    assert mark not in worker_log(stack)


@pytest.mark.parametrize("tag", ["object", "string", "not_utf8", "pickle", "well_formed"])
def test_a_malformed_message_without_a_task_id_is_logged_by_its_size_only(
        stack: WorkerStack, tag: str) -> None:
    mark = marker()
    poison = NO_ID[tag](mark)
    probe = uuid.uuid4().hex
    size = publish(stack, poison, None, probe)

    eventually(lambda: not still_queued(stack, probe), 60, "the message taken off the queue")
    eventually(lambda: f"a task message without a task id ({size} bytes" in worker_log(stack),
               30, "the refusal logged by its size")
    assert_the_worker_serves(stack)
    assert mark not in worker_log(stack)


def test_after_every_poison_message_an_acquire_by_name_still_succeeds(
        stack: WorkerStack) -> None:
    run_id = f"poison-after-{uuid.uuid4().hex[:8]}"
    lease = producer.acquire_lease(run_id, {"provider": "noop"}).get(timeout=120)
    assert lease["result"] == "acquired"
    assert_the_worker_serves(stack)


@pytest.mark.parametrize("body", [{"run_id": "kb-8"}, [[], {"run_id": "kb-8"}, {}]])
def test_an_unknown_task_name_without_a_task_id_is_dropped_and_the_worker_goes_on(
        stack: WorkerStack, body: Any) -> None:
    # Celery's report of an unknown name looks the id up in the body when the headers have
    # none: a KeyError (which kombu's Redis transport counts as a connection error: Celery
    # reconnected and took the message again, for ever) or a TypeError (fatal).
    probe = uuid.uuid4().hex
    size = publish(stack, Poison(json.dumps(body), headers={"task": "lease.acquier"}), None,
                   probe)
    eventually(lambda: not still_queued(stack, probe), 60, "the message taken off the queue")
    eventually(lambda: f"a task message without a task id ({size} bytes" in worker_log(stack),
               30, "the refusal logged by its size")
    assert_the_worker_serves(stack)
    assert "Connection to broker lost" not in worker_log(stack)
