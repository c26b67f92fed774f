"""A task retries a transient failure LEASEKEEPER_TASK_MAX_RETRIES times, as the README's
retry policy says: not Celery's own default of 3."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks import producer
from tests.services import PostgresServer, RedisServer
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
    # and its final error says it gave up, not that it is retried until the run is recorded
    text = str(caught.value)
    assert "is retried until" not in text, text
    assert text == (f"no run {run_id!r} yet; acquire a lease for it first; the task gave up "
                    f"after {RETRIES} retries (LEASEKEEPER_TASK_MAX_RETRIES)"), text


def test_a_detach_for_a_run_never_recorded_says_it_gave_up(retry_stack: WorkerStack) -> None:
    # Before: "... (a call sent right behind its lease.acquire is retried until the run is
    # recorded)" as the final error: a web backend showed a request as still retried.
    run_id = f"never-{uuid.uuid4().hex[:12]}"
    with pytest.raises(Exception, match="no run") as caught:
        producer.detach_run(run_id).get(120)
    assert type(caught.value).__name__ == "RunNotRecorded"
    text = str(caught.value)
    assert "is retried until" not in text and text.endswith(
        f"; the task gave up after {RETRIES} retries (LEASEKEEPER_TASK_MAX_RETRIES)"), text


@pytest.mark.postgres
def test_a_task_that_gave_up_on_the_store_says_so_not_that_it_will_retry(
        redis_server: RedisServer, postgres_server: PostgresServer, tmp_path: Path) -> None:
    # Before: an acquire whose store stayed down past its retries failed with
    # "... is unavailable (...); the task will retry", in Flower, the result and the log:
    # it had stopped retrying.
    import psycopg

    from models.migrate import upgrade
    from tests.stack import WorkerStack, sending_to

    name = f"lk_{uuid.uuid4().hex[:12]}"
    store_url = postgres_server.create_database(name)
    upgrade(store_url)
    queue = f"gaveup-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue,
                                   "LEASEKEEPER_TASK_MAX_RETRIES": "2",
                                   "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "0.05",
                                   "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "0.1"})
    admin = f"postgresql://postgres@127.0.0.1:{postgres_server.port}/postgres"
    with sending_to(queue):
        try:
            stack.start_worker()
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE datname = %s", (name,))
            sent = producer.acquire_lease(f"run-{uuid.uuid4().hex[:8]}", {"provider": "noop"})
            with pytest.raises(Exception) as caught:
                sent.get(120)
            said = str(caught.value)
            assert type(caught.value).__name__ == "StoreUnavailable", said
            assert "is unavailable" in said and "will retry" not in said, said
            assert said.endswith("; the task gave up after 2 retries "
                                 "(LEASEKEEPER_TASK_MAX_RETRIES)"), said
            from tests.e2e.conftest import eventually

            # the worker logs the failure after it stored the result
            eventually(lambda: "gave up after 2 retries" in stack.logfile.read_text(
                errors="replace"), 30, "the worker to log that the task gave up")
            final = [line for line in stack.logfile.read_text(errors="replace").splitlines()
                     if "gave up after" in line]
            assert final and not any("will retry" in line for line in final), final
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            stack.stop()
