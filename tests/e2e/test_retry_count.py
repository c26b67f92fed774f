"""A task retries a transient failure LEASEKEEPER_TASK_MAX_RETRIES times, as the README's
retry policy says: not Celery's own default of 3."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from tasks import producer
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack

RETRIES = 7  # over Celery's default max_retries (3), so the setting is what counts


@pytest.fixture(scope="module")
def retry_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[WorkerStack]:
    with own_queue_stack("retries", redis_server.url, tmp_path_factory.mktemp("retries"),
                         {"LEASEKEEPER_TASK_MAX_RETRIES": str(RETRIES),
                          "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "0.05",
                          "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "0.1"}) as stack:
        yield stack


def test_a_transient_failure_is_retried_as_often_as_the_setting_says(
        retry_stack: WorkerStack) -> None:
    # A run.finish for a run never recorded is transient (RunNotRecorded: its acquire may
    # be behind it) until the retries run out.
    run_id = f"never-{uuid.uuid4().hex[:12]}"
    sent = producer.finish_run(run_id, "completed", 0)
    with pytest.raises(Exception, match="no run") as caught:
        sent.get(120)
    assert type(caught.value).__name__ == "RunNotRecorded"
    log = retry_stack.logfile.read_text(errors="replace")
    retries = re.findall(rf"run\.finish\[{sent.id}\] transient failure, retry (\d+) in", log)
    assert retries == [str(n) for n in range(1, RETRIES + 1)], log[-3000:]
