"""Free text a store keeps (a run's error, a lease's destroy reason) never acts on the
terminal that shows it, and a line break in it never breaks a CLI table.

Through a real worker on real Redis and SQLite, the test process acting as a web backend
and `leasekeeper` run as a child process. Before (a QA pass): C1 controls (CSI ``\\x9b``,
OSC ``\\x9d``, ST ``\\x9c``) and bidi overrides/isolates were stored and printed raw by
`runs show` (an error could clear the operator's screen or set the terminal's title), and
a newline in a destroy reason printed as a row of its own in `leases list`, so a reason
could fake a lease's row.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tasks import producer
from tests.e2e.conftest import leasekeeper
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)

C1 = "A\x9b2JB\x9d0;pwned\x9cC end"
BIDI = "x\u202eevil\u202c\u2066iso\u2069\u202a\u202b\u202d\u2067\u2068y"
ACTING = {chr(c) for c in range(0x80, 0xA0)} | set("\u202a\u202b\u202c\u202d\u202e"
                                                   "\u2066\u2067\u2068\u2069")


@pytest.fixture(scope="module")
def text_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with own_queue_stack("text", redis_server.url, tmp_path_factory.mktemp("text")) as stack:
        yield stack


def acquired(prefix: str) -> tuple[str, str]:
    run_id = f"{prefix}-{uuid.uuid4().hex[:10]}"
    done = producer.acquire_lease(run_id, {"provider": "noop",
                                           "thread_id": f"th-{run_id}"}).get(90)
    return run_id, str(done["lease_id"])


def acting(text: str) -> set[str]:
    return {c for c in text if c in ACTING}


@pytest.mark.parametrize("sender", ["producer", "by name"])
def test_c1_and_bidi_controls_in_an_error_are_stored_and_shown_replaced(
        text_stack: WorkerStack, sender: str) -> None:
    run_id, _lease = acquired("tx")
    error = C1 + " " + BIDI
    if sender == "producer":
        producer.finish_run(run_id, "failed", 1, error=error).get(90)
    else:
        app.send_task("run.finish", kwargs={"run_id": run_id, "status": "failed",
                                            "exit_code": 1, "error": error}).get(90)
    run = text_stack.runtime().store.get_run(run_id)
    assert run is not None and run.error is not None
    assert not acting(run.error), repr(run.error)
    assert run.error == ("A\ufffd2JB\ufffd0;pwned\ufffdC end x\ufffdevil\ufffd\ufffdiso"
                         "\ufffd\ufffd\ufffd\ufffd\ufffd\ufffdy")
    shown = leasekeeper("runs", "show", run_id, env=text_stack.env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert not acting(shown.stdout), repr(shown.stdout)
    assert "pwned" in shown.stdout


def test_a_destroy_reason_with_bidi_controls_is_stored_replaced(
        text_stack: WorkerStack) -> None:
    _run, lease_id = acquired("tb")
    producer.destroy_lease(lease_id, reason="r " + BIDI + " \x85\x9b").get(90)
    rt = text_stack.runtime()
    reasons = [e.reason for e in rt.store.events(lease_id)] + [
        rt.store.get_lease(lease_id).end_reason or ""]
    assert not acting("".join(reasons)), reasons
    shown = leasekeeper("leases", "show", lease_id, env=text_stack.env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert not acting(shown.stdout), repr(shown.stdout)


def test_a_newline_in_a_reason_or_an_error_stays_in_its_table_row(
        text_stack: WorkerStack) -> None:
    _run, lease_id = acquired("tn")
    run_id, _lease = acquired("tn")  # its run fails (and a reclaim destroys its lease)
    fake = "01a2521a8071a84b68c5ee4329919999 active local acme FAKE"
    producer.destroy_lease(lease_id, reason="x\n" + fake + "\r\tz").get(90)
    producer.finish_run(run_id, "failed", 1, error="boom\n" + fake).get(90)
    rt = text_stack.runtime()
    assert rt.store.get_lease(lease_id).state == "destroyed"
    assert any("\n" in e.reason for e in rt.store.events(lease_id))  # kept, as storable does

    listed = leasekeeper("leases", "list", "--limit", "4", env=text_stack.env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = listed.stdout.splitlines()
    assert not any(line.startswith("01a2521a8071") for line in rows), listed.stdout
    ours = [line for line in rows if line.startswith(lease_id)]
    assert len(ours) == 1 and "x\\n01a2521a8071" in ours[0], listed.stdout
    assert "\\r\\tz" in ours[0], ours[0]

    history = leasekeeper("leases", "show", lease_id, env=text_stack.env)
    assert history.returncode == 0, history.stdout + history.stderr
    assert not any(line.startswith("01a2521a8071") for line in history.stdout.splitlines())
    assert "x\\n01a2521a8071" in history.stdout, history.stdout

    # `runs show`: the error's lines stay multi-line, each continuation indented under
    # the value, so none reads as a field of its own
    shown = leasekeeper("runs", "show", run_id, env=text_stack.env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    assert lines[at].endswith(" boom"), lines[at]
    assert lines[at + 1].strip() == fake and lines[at + 1].startswith(" " * 8), lines[at + 1]
