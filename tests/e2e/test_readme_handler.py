"""The README's request-handler example, run as written against a real worker: a bad
request is a 422 with the producer's reason, a good one a 202 with the task id, and the
status function answers the lease once the worker has made it."""

from __future__ import annotations

import uuid
from typing import Any

from tests.e2e.conftest import eventually
from tests.stack import REPO, WorkerStack


def readme_handler() -> dict[str, Any]:
    """The README's handler code block, executed as it stands."""
    text = (REPO / "README.md").read_text()
    at = text.index("def start_run(run_id: str")
    block = text[text.rindex("```python", 0, at) + len("```python"):text.index("```", at)]
    names: dict[str, Any] = {"__name__": "readme_handler"}
    exec(compile(block, "README.md", "exec"), names)  # our own README's code
    return names


def test_the_readme_request_handler_works_as_written(stack: WorkerStack) -> None:
    handler = readme_handler()
    code, body = handler["start_run"]("bad id!", {})
    assert code == 422 and "run_id" in body["error"]
    code, body = handler["start_run"](f"run-{uuid.uuid4().hex[:12]}", {"tenant": "acme"})
    assert code == 202
    status = eventually(lambda: (s := handler["acquire_status"](body["task_id"]))
                        and s["state"] == "SUCCESS" and s, 60, "the acquire")
    assert status["error"] is None and status["lease"]["state"] == "active"
    lease_id = status["lease"]["lease_id"]
    assert stack.runtime().store.get_lease(lease_id).tenant == "acme"
    from tasks import producer

    assert producer.destroy_lease(lease_id).get(60)["result"] == "destroyed"
