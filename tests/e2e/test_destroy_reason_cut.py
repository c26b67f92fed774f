"""A destroy's reason keeps no part of a secret that straddles a cut, whoever sends it.

Through a real worker on real Redis and SQLite, the test process acting as a web backend
(it never saw the secrets: the acquires go by name). Before, ``producer.destroy_lease``
(and so ``leasekeeper leases destroy --reason``) cut the reason to 200 characters before
sending it, so the worker's secret marks saw only a prefix of a secret straddling that
cut, matched nothing, and the lease's history kept it (``destroy: eeee...EventCut-S``: a
QA pass); the same reason sent by name was stored as ``eeee...***``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from providers.spec import MAX_ENV_VALUE_CHARS
from tasks import producer
from tasks.destroy import END_REASON_MAX_CHARS, REASON_MAX_CHARS
from tests.e2e.conftest import leasekeeper
from tests.e2e.test_finish_error_cut import shows_part_of
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def reason_stack(redis_server: RedisServer, tmp_path: Path) -> Any:
    with own_queue_stack("reason", redis_server.url, tmp_path) as stack:
        yield stack


def acquired(secret: str) -> str:
    """A lease whose run has ``secret`` in its secret_env, acquired by name."""
    run_id = f"rc-{uuid.uuid4().hex[:10]}"
    done = app.send_task("lease.acquire", kwargs={
        "run_id": run_id, "spec": {"provider": "noop", "thread_id": f"th-{run_id}",
                                   "secret_env": {"L": secret}}}).get(90)
    return str(done["lease_id"])


def stored_reasons(stack: WorkerStack, lease_id: str) -> list[str]:
    """The lease's end reason, then the reasons of its history's destroy events."""
    rt = stack.runtime()
    lease = rt.store.get_lease(lease_id)
    assert lease.state == "destroyed", lease.state
    events = [e.reason for e in rt.store.events(lease_id) if e.reason.startswith("destroy")]
    assert len(events) == 2, events  # "destroy: ..." and "destroyed (destroyed): ..."
    return [lease.end_reason or "", *events]


def test_a_reason_straddling_the_kept_length_is_scrubbed_whole_by_every_sender(
        reason_stack: WorkerStack) -> None:
    secret = f"EventCut-Secret-{uuid.uuid4().hex}"
    reason = "e" * 190 + secret
    by_producer, by_name, by_cli = acquired(secret), acquired(secret), acquired(secret)
    producer.destroy_lease(by_producer, reason=reason).get(90)
    app.send_task("lease.destroy", kwargs={"lease_id": by_name, "reason": reason}).get(90)
    done = leasekeeper("leases", "destroy", by_cli, "--reason", reason, env=reason_stack.env)
    assert done.returncode == 0, done.stdout + done.stderr
    kept = "e" * 190 + "***"
    expected = [kept[:END_REASON_MAX_CHARS], f"destroy: {kept}",
                f"destroyed (destroyed): {kept}"]
    for lease_id in (by_producer, by_name, by_cli):
        stored = stored_reasons(reason_stack, lease_id)
        assert not any(shows_part_of(text, secret, 6) for text in stored), stored
        assert stored == expected, stored


def test_a_reason_over_the_payload_limit_is_cut_to_fit_and_scrubbed(
        reason_stack: WorkerStack) -> None:
    # 6 bytes each as JSON: the reason cannot go whole; the producer cuts it to fit, and
    # says so, where before it sent 200 characters and the worker could not tell.
    secret = f"EventCut-Secret-{uuid.uuid4().hex}"
    lease_id = acquired(secret)
    producer.destroy_lease(lease_id, reason="x" * 150 + secret + "\u00e9" * 300000).get(90)
    note = f"... [{150 + 3 + 300000} characters; the rest cut]"
    kept = "x" * 150 + "***" + "\u00e9" * (REASON_MAX_CHARS - 153 - len(note)) + note
    assert stored_reasons(reason_stack, lease_id)[1:] == [
        f"destroy: {kept}", f"destroyed (destroyed): {kept}"]


def test_a_secret_split_by_the_producers_cut_of_a_reason_is_never_shown(
        reason_stack: WorkerStack) -> None:
    # The longest secret there may be, repeated: the producer has to cut inside a copy.
    secret = "".join(uuid.uuid4().hex for _ in range(MAX_ENV_VALUE_CHARS // 32 + 1))
    secret = secret[:MAX_ENV_VALUE_CHARS]
    lease_id = acquired(secret)
    producer.destroy_lease(lease_id, reason=secret * 9 + "z" * 1000).get(90)
    stored = stored_reasons(reason_stack, lease_id)
    assert not any(shows_part_of(text, secret, 6) for text in stored), stored
    body, _, tail = stored[1].removeprefix("destroy: ").rpartition("... [")
    assert set(body) <= {"*"}, body  # only what the scrub wrote
    assert tail.endswith(" characters; the rest cut]"), tail


def test_a_forget_reason_keeps_no_secret_of_the_lease_and_is_cut_to_fit(
        reason_stack: WorkerStack) -> None:
    # Before: `leases forget --reason` wrote the operator's text into the history as given,
    # unscrubbed and uncut (an operator pasting what they saw when removing the sandbox by
    # hand: a QA pass). It is now cleaned as a destroy's reason is.
    from models.schema import LeaseState

    secret = f"Forget-Secret-{uuid.uuid4().hex}"
    lease_id = acquired(secret)
    rt = reason_stack.runtime()
    assert rt.store.transition(lease_id, {LeaseState.ACTIVE}, LeaseState.ABANDONED,
                               "test: cleanup gave up") is not None
    reason = f"removed by hand; its env said L={secret} " + "y" * 5000
    done = leasekeeper("leases", "forget", lease_id, "--reason", reason, env=reason_stack.env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    forgot = [e.reason for e in rt.store.events(lease_id) if "forgotten" in e.reason]
    assert len(forgot) == 1, forgot
    assert not shows_part_of(forgot[0], secret, 6), forgot
    assert forgot[0].startswith("operator: forgotten (removed by hand; its env said L=***"), forgot
    assert len(forgot[0]) <= REASON_MAX_CHARS + len("operator: forgotten ()"), len(forgot[0])
