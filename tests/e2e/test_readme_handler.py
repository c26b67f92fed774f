"""The README's request-handler example, run as written against a real worker: a bad
request is a 422 with the producer's reason, a good one a 202 with the task id, and the
status function answers the lease once the worker has made it; with the broker down, the
status function answers 503 with the producer's BrokerUnavailable (before, it raised
redis' own ConnectionError: a view answered 500; a QA pass)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from tests.e2e.conftest import cli_env, eventually
from tests.services import free_port
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
                        and s[1]["state"] == "SUCCESS" and s[1], 60, "the acquire")
    assert status["error"] is None and status["lease"]["state"] == "active"
    lease_id = status["lease"]["lease_id"]
    assert stack.runtime().store.get_lease(lease_id).tenant == "acme"
    from tasks import producer

    assert producer.destroy_lease(lease_id).get(60)["result"] == "destroyed"


STATUS = """
import json, sys
from tests.e2e.test_readme_handler import readme_handler
print(json.dumps(readme_handler()["acquire_status"](sys.argv[1])))
"""


def test_the_readme_status_function_answers_503_when_the_broker_is_down(
        tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    env = cli_env(LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:{port}/0")
    done = subprocess.run([sys.executable, "-c", STATUS, str(uuid.uuid4())], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    code, body = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 503, body
    assert body["error"].startswith(
        f"the broker at redis://127.0.0.1:{port}/0 (LEASEKEEPER_BROKER_URL) is unreachable ("
    ), body
    assert "Start Redis there or fix the URL, then retry." in body["error"]
