"""What the README's "Enqueueing from a web backend" says a web backend meets, on a real
worker: a result expires after LEASEKEEPER_RESULT_EXPIRES_S (a setting since a QA pass;
before, 24 h fixed in workers/app.py) and then reads PENDING; a task no worker consumes
times out in `.get()` with Celery's TimeoutError and reads PENDING."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import celery.exceptions
import pytest
import redis

from tasks import producer
from tasks.producer import TaskState
from tests.e2e.conftest import eventually
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack, sending_to

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def short_results(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[WorkerStack]:
    with own_queue_stack("expires", redis_server.url, tmp_path_factory.mktemp("expires"),
                         {"LEASEKEEPER_RESULT_EXPIRES_S": "2"}) as stack:
        yield stack


def test_a_result_expires_after_the_setting_and_then_reads_pending(
        short_results: WorkerStack, redis_server: RedisServer) -> None:
    sent = producer.acquire_lease(f"run-{uuid.uuid4().hex[:10]}", {"provider": "noop"})
    assert sent.get(60)["result"] == "acquired"
    assert producer.task_status(sent.id).state == TaskState.SUCCESS
    ttl = redis.Redis.from_url(redis_server.url).ttl(f"celery-task-meta-{sent.id}")
    assert 0 < ttl <= 2, ttl  # the worker's expiry, not Celery's 24 h
    eventually(lambda: producer.task_status(sent.id).state == TaskState.PENDING, 60,
               "the expired result reading PENDING")


def test_a_task_no_worker_consumes_times_out_and_reads_pending(tmp_path: Path) -> None:
    with sending_to(f"nobody-{uuid.uuid4().hex[:8]}"):
        sent = producer.acquire_lease(f"run-{uuid.uuid4().hex[:10]}", {"provider": "noop"})
        with pytest.raises(celery.exceptions.TimeoutError):
            sent.get(timeout=1)
        assert producer.task_status(sent.id).state == TaskState.PENDING
