"""A run's error keeps no part of a secret that straddles a cut, whoever cuts it.

Through a real worker on real Redis and SQLite, the test process acting as a web backend
(it never saw the secrets: the acquires go by name). Before, ``producer.finish_run`` cut
the error to 2,000 characters before sending it, so the worker's secret marks saw only a
prefix of a secret straddling that cut, matched nothing, and the store kept the prefix
(``...xxxxcut-s3cret-VA... [101977 characters; the rest cut]``: a QA pass).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from providers.spec import MAX_ENV_VALUE_CHARS
from tasks import producer
from tasks.runs import ERROR_MAX_CHARS
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cut_stack(redis_server: RedisServer, tmp_path: Path) -> Any:
    with own_queue_stack("cut", redis_server.url, tmp_path) as stack:
        yield stack


def acquired(secret: str) -> str:
    """A run whose lease has ``secret`` in its secret_env, acquired by name."""
    run_id = f"ct-{uuid.uuid4().hex[:10]}"
    app.send_task("lease.acquire", kwargs={
        "run_id": run_id, "spec": {"provider": "noop", "thread_id": f"th-{run_id}",
                                   "secret_env": {"T": secret}}}).get(90)
    return run_id


def stored_error(stack: WorkerStack, run_id: str) -> str:
    run = stack.runtime().store.get_run(run_id)
    assert run is not None and run.status == "failed" and run.error is not None
    assert len(run.error) <= ERROR_MAX_CHARS
    return run.error


def pieces(secret: str, size: int = 10) -> set[str]:
    return {secret[i:i + size] for i in range(len(secret) - size + 1)}


def shows_part_of(text: str, secret: str, size: int = 10) -> bool:
    parts = pieces(secret, size)
    return any(text[i:i + size] in parts for i in range(len(text) - size + 1))


def test_an_error_straddling_the_cut_is_scrubbed_whole_by_producer_and_by_name(
        cut_stack: WorkerStack) -> None:
    secret = f"cut-s3cret-{uuid.uuid4().hex}"
    error = "x" * 1950 + secret + "y" * 100000
    by_producer, by_name = acquired(secret), acquired(secret)
    producer.finish_run(by_producer, "failed", 1, error=error).get(90)
    app.send_task("run.finish", kwargs={"run_id": by_name, "status": "failed",
                                        "exit_code": 1, "error": error}).get(90)
    note = f"... [{1950 + 3 + 100000} characters; the rest cut]"
    expected = "x" * 1950 + "***" + "y" * (ERROR_MAX_CHARS - 1953 - len(note)) + note
    assert stored_error(cut_stack, by_producer) == expected
    assert stored_error(cut_stack, by_name) == expected  # the worker's own cut: the same


def test_an_error_over_the_payload_limit_is_cut_to_fit_and_scrubbed(
        cut_stack: WorkerStack) -> None:
    # 6 bytes each as JSON: the error cannot go whole; the producer cuts it to fit.
    secret = f"cut-s3cret-{uuid.uuid4().hex}"
    error = "x" * 1950 + secret + "\u00e9" * 300000
    run_id = acquired(secret)
    producer.finish_run(run_id, "failed", 1, error=error).get(90)
    note = f"... [{1950 + 3 + 300000} characters; the rest cut]"
    assert stored_error(cut_stack, run_id) == (
        "x" * 1950 + "***" + "\u00e9" * (ERROR_MAX_CHARS - 1953 - len(note)) + note)


def test_a_secret_split_by_the_producers_cut_is_never_shown(cut_stack: WorkerStack) -> None:
    # The longest secret there may be, repeated: scrubbed, each copy is three characters,
    # so what the run keeps reaches where the producer had to cut, inside a copy.
    secret = "".join(uuid.uuid4().hex for _ in range(MAX_ENV_VALUE_CHARS // 32 + 1))
    secret = secret[:MAX_ENV_VALUE_CHARS]
    run_id = acquired(secret)
    producer.finish_run(run_id, "failed", 1, error=secret * 9 + "z" * 1000).get(90)
    kept = stored_error(cut_stack, run_id)
    assert not shows_part_of(kept, secret), kept[:300]
    # what the worker could not see whole is not kept: only what the scrub wrote, the note
    body, _, tail = kept.rpartition("... [")
    assert set(body) <= {"*", "z"}, body[:300]
    assert re.fullmatch(r"\d+ characters; the rest cut\]", tail), tail


def test_the_error_of_a_run_given_no_secret_keeps_what_was_sent(cut_stack: WorkerStack
                                                                ) -> None:
    # Before: a long error of emoji (12 bytes each as JSON) that the producer had to cut
    # was stored as nothing but the note ('... [22011 characters; the rest cut]'): the
    # worker dropped the last 32,832 characters before a sender's cut, which could hold a
    # split secret, though the run was given none.
    run_id = f"ct-{uuid.uuid4().hex[:10]}"
    app.send_task("lease.acquire", kwargs={
        "run_id": run_id, "spec": {"provider": "noop", "thread_id": f"th-{run_id}"}}).get(90)
    error = "Traceback: " + "\U0001f600" * 22000
    producer.finish_run(run_id, "failed", 1, error=error).get(90)
    note = f"... [{len(error)} characters; the rest cut]"
    assert stored_error(cut_stack, run_id) == error[:ERROR_MAX_CHARS - len(note)] + note
