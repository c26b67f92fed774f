"""The producer refuses a bad id in the worker's own words: what a web backend shows for
``producer.destroy_lease("not a lease")`` is what the worker answers the same payload sent
by name (``invalid lease.destroy payload: lease_id must be ...``). Before, the producer's
refusal lacked the ``invalid <task> payload:`` prefix every other refusal has (a QA pass)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from providers.errors import InvalidRequest
from tasks import producer
from tests.stack import WorkerStack
from workers.app import app

BAD = "not a lease"
CASES: list[tuple[str, str, Callable[[str], Any]]] = [
    ("lease.destroy", "lease_id", producer.destroy_lease),
    ("lease.resume_check", "lease_id", producer.check_resumable),
    ("lease.touch", "lease_id", producer.touch_lease),
    ("run.detach", "run_id", producer.detach_run),
    ("run.attach", "run_id", producer.attach_run),
    ("sandbox.reclaim", "run_id", producer.reclaim_run),
]


@pytest.mark.parametrize(("task", "field", "send"), CASES, ids=[c[0] for c in CASES])
def test_the_producer_refuses_a_bad_id_as_the_worker_does(
        stack: WorkerStack, task: str, field: str, send: Callable[[str], Any]) -> None:
    with pytest.raises(InvalidRequest) as by_name:
        app.send_task(task, kwargs={field: BAD}).get(60)
    with pytest.raises(InvalidRequest) as by_producer:
        send(BAD)
    assert str(by_name.value).startswith(f"invalid {task} payload: {field} must be")
    assert str(by_producer.value) == str(by_name.value)
