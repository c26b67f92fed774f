"""``producer.task_status``: what a web backend polls with a task id, through a real
worker on real Redis: a success's result, a failure's reason, an unknown id pending; a
task id that is not one is refused before Redis is asked."""

from __future__ import annotations

import uuid

import pytest

from providers.errors import InvalidRequest
from tasks import producer
from tests.e2e.conftest import eventually
from tests.stack import WorkerStack


def test_task_status_says_success_failure_and_pending(stack: WorkerStack) -> None:
    sent = producer.acquire_lease(f"run-{uuid.uuid4().hex[:12]}", {"provider": "noop"})
    done = eventually(lambda: (s := producer.task_status(sent.id)).state == "SUCCESS" and s,
                      60, "the acquire")
    assert done.error is None and done.result is not None
    assert done.result["state"] == "active" and done.result["provider"] == "noop"

    gone = producer.destroy_lease(done.result["lease_id"], "a")
    assert gone.get(60)["result"] == "destroyed"
    failing = producer.check_resumable(f"nolease-{uuid.uuid4().hex[:8]}")
    failed = eventually(lambda: (s := producer.task_status(failing.id)).state == "FAILURE"
                        and s, 60, "the resume check of an unknown lease")
    assert failed.result is None and failed.error is not None and "nolease-" in failed.error

    pending = producer.task_status(str(uuid.uuid4()))  # no such task: Celery cannot tell
    assert (pending.state, pending.result, pending.error) == ("PENDING", None, None)


@pytest.mark.parametrize("task_id", ["", None, 7, "x" * 256, "has space"])
def test_task_status_refuses_what_is_no_task_id(task_id: object) -> None:
    with pytest.raises(InvalidRequest, match="task_id must be"):
        producer.task_status(task_id)  # type: ignore[arg-type]


def test_task_status_of_a_task_name_no_worker_has_says_so(stack: WorkerStack) -> None:
    # Before: error="'lease.aquire'" (the repr of Celery's NotRegistered, a KeyError): it
    # did not say the name is unknown.
    from workers.app import app

    sent = app.send_task("lease.aquire", kwargs={"run_id": f"r-{uuid.uuid4().hex[:8]}"})
    failed = eventually(lambda: (s := producer.task_status(sent.id)).state == "FAILURE" and s,
                        60, "the unknown task's failure")
    assert failed.error is not None and failed.error.startswith(
        "unknown task 'lease.aquire': no worker of this installation has a task of that "
        "name"), failed.error
    assert "lease.acquire" in failed.error, failed.error  # the names it could have meant
