"""A payload refused for a bad value never quotes that value: it may be a secret.

Through a real worker on real Redis and SQLite. Before, ``run.finish`` with a status that
was a ``secret_env`` value of the run (a caller that mixed up its variables) was refused
with ``status must be one of ...; got 'TokSecretAlpha77'`` in the task result (Redis,
Flower) and the worker log, from the producer and by name alike: the pool process that
refused it had not seen the acquire, so no scrub knew the value (a QA pass). README:
"validation errors never echo input values".
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from providers.errors import InvalidRequest
from tasks import producer
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)

SECRET = "TokSecretAlpha77"


@pytest.fixture
def echo_stack(redis_server: RedisServer, tmp_path: Path) -> Any:
    with own_queue_stack("echo", redis_server.url, tmp_path) as stack:
        yield stack


def refusal(send: Any) -> str:
    with pytest.raises(InvalidRequest) as err:
        send()
    return str(err.value)


def refusal_by_name(name: str, kwargs: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as err:
        app.send_task(name, kwargs=kwargs).get(90)
    return str(err.value)


def test_a_refused_finish_or_id_says_what_was_sent_without_quoting_it(
        echo_stack: WorkerStack, redis_server: RedisServer) -> None:
    run_id = f"rq-{uuid.uuid4().hex[:10]}"
    app.send_task("lease.acquire", kwargs={
        "run_id": run_id, "spec": {"provider": "noop", "thread_id": f"th-{run_id}",
                                   "secret_env": {"T": SECRET}}}).get(90)
    said = [
        refusal(lambda: producer.finish_run(run_id, SECRET)),
        refusal(lambda: producer.finish_run(run_id, "failed", SECRET)),  # type: ignore[arg-type]
        refusal(lambda: producer.attach_run(f"bad id {SECRET}")),
        refusal(lambda: producer.task_status(f"bad id {SECRET}")),
    ]
    for name, kwargs in [
            ("run.finish", {"run_id": run_id, "status": SECRET}),
            ("run.finish", {"run_id": run_id, "status": "failed", "exit_code": SECRET}),
            ("run.attach", {"run_id": f"bad id {SECRET}"}),
            ("lease.touch", {"lease_id": SECRET + "/.."})]:
        # several, so the pool process that did not run the acquire refuses some
        for _ in range(3):
            said.append(refusal_by_name(name, kwargs))
    for message in said:
        assert SECRET not in message and "Alpha77" not in message, message
    assert "status must be one of" in said[0] and "got a string of 16 characters" in said[0]
    assert "got a string of 16 characters" in said[1], said[1]
    assert "got a string of 23 characters" in said[2], said[2]
    assert "got a string of 23 characters" in said[3], said[3]
    assert "got a string of 16 characters" in said[4], said[4]
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter("celery-task-meta-*"):
        assert SECRET.encode() not in (client.get(key) or b""), key
    log = echo_stack.logfile.read_text(errors="replace")
    assert "status must be one of" in log
    assert SECRET not in log
