"""A secret holding a C1 or bidi control character is scrubbed from a run's error and a
destroy's reason whoever sends them, and however the text was cleaned before.

Through a real worker on real Redis and SQLite, the test process acting as a web backend
(it never saw the secrets: the acquires go by name). Before, ``producer.finish_run`` and
``producer.destroy_lease`` (so ``leasekeeper leases destroy --reason`` too) replaced
control characters with U+FFFD (tasks/text.py ``storable``) before sending, and the
worker's secret marks, digests of each value as given, then matched nothing: the store
kept ``E=C1sec\\ufffdretZZ9 B=Bidi\\ufffdSecret_Q9`` (a QA pass), where by name it kept
``E=*** B=***``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tasks import producer
from tasks.text import storable
from tests.e2e.conftest import leasekeeper
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)

C1 = "C1sec\x85retZZ9"  # NEL, a C1 control
BIDI = "Bidi\u202eSecret_Q9"  # RIGHT-TO-LEFT OVERRIDE
TEXT = f"E={C1} B={BIDI}"
SCRUBBED = "E=*** B=***"


@pytest.fixture
def ctl_stack(redis_server: RedisServer, tmp_path: Path) -> Any:
    with own_queue_stack("ctl", redis_server.url, tmp_path) as stack:
        yield stack


def acquired() -> tuple[str, str]:
    """A run and its lease, given both secrets, acquired by name."""
    run_id = f"cc-{uuid.uuid4().hex[:10]}"
    done = app.send_task("lease.acquire", kwargs={
        "run_id": run_id, "spec": {"provider": "noop", "thread_id": f"th-{run_id}",
                                   "secret_env": {"E": C1, "B": BIDI}}}).get(90)
    return run_id, str(done["lease_id"])


def shows_a_secret(text: str) -> bool:
    return any(part in text for part in ("C1sec", "retZZ9", "Secret_Q9", "Bidi"))


def test_a_run_error_quoting_control_character_secrets_is_scrubbed_by_every_sender(
        ctl_stack: WorkerStack) -> None:
    by_producer, by_name, cleaned_first = (acquired()[0] for _ in range(3))
    producer.finish_run(by_producer, "failed", 1, error=TEXT).get(90)
    app.send_task("run.finish", kwargs={"run_id": by_name, "status": "failed",
                                        "exit_code": 1, "error": TEXT}).get(90)
    # a sender that cleaned the text before sending (as the producer did): the marks
    # know each secret's cleaned form too
    app.send_task("run.finish", kwargs={"run_id": cleaned_first, "status": "failed",
                                        "exit_code": 1, "error": storable(TEXT)}).get(90)
    store = ctl_stack.runtime().store
    for run_id in (by_producer, by_name, cleaned_first):
        run = store.get_run(run_id)
        assert run is not None and run.error is not None
        assert not shows_a_secret(run.error), run.error
        assert run.error == SCRUBBED, run.error


def test_a_destroy_reason_quoting_control_character_secrets_is_scrubbed_by_every_sender(
        ctl_stack: WorkerStack) -> None:
    by_producer, by_name, by_cli = (acquired()[1] for _ in range(3))
    producer.destroy_lease(by_producer, reason=TEXT).get(90)
    app.send_task("lease.destroy", kwargs={"lease_id": by_name, "reason": TEXT}).get(90)
    done = leasekeeper("leases", "destroy", by_cli, "--reason", TEXT, env=ctl_stack.env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not shows_a_secret(done.stdout + done.stderr)
    store = ctl_stack.runtime().store
    for lease_id in (by_producer, by_name, by_cli):
        lease = store.get_lease(lease_id)
        assert lease.state == "destroyed", lease.state
        reasons = [lease.end_reason or "", *(e.reason for e in store.events(lease_id)
                                             if e.reason.startswith("destroy"))]
        assert not any(shows_a_secret(r) for r in reasons), reasons
        assert reasons == [SCRUBBED, f"destroy: {SCRUBBED}",
                           f"destroyed (destroyed): {SCRUBBED}"], reasons
