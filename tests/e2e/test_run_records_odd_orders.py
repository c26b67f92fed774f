"""Run records through the broker and a real Celery worker, used the way a web backend
would (the producer, or task names with JSON payloads), in odd orders and with payloads a
backend gets wrong, on SQLite and PostgreSQL: afterwards the run and lease records tell
the truth, nothing is left live that no run needs, and no secret the worker knows of is
kept in a run's error, the task result, the log or the lease's events."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from models.invariants import check
from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.errors import AcquireCancelled, InvalidRequest, NotFound
from tasks import producer
from tests.e2e.conftest import eventually
from tests.services import RedisServer
from tests.stack import WorkerStack, sending_to
from workers.app import app
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def rid(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def acquire(spec: dict[str, Any] | None = None, run_id: str | None = None) -> tuple[str, str]:
    run_id = run_id or rid()
    return run_id, producer.acquire_lease(run_id, spec or {}).get(60)["lease_id"]


def by_name(name: str, **kwargs: Any) -> Any:
    """What a backend without leasekeeper installed sends: the task name, JSON kwargs."""
    return app.send_task(name, kwargs=kwargs).get(60)


def reclaimed(rt: Runtime, run_id: str) -> Any:
    return eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                      60, f"the reclaim of {run_id}")


def truthful(rt: Runtime, *ids: str) -> None:
    """No invariant of `leasekeeper check` is broken for these runs or leases."""
    found = [v.describe() for v in check(rt.store, utcnow(), rt.settings.claim_timeout_s)
             if v.run_id in ids or v.lease_id in ids]
    assert found == []


def leftover(rt: Runtime, provider: str, lease_id: str) -> list[str]:
    return [r.name for r in rt.provider(provider).list_managed() if r.lease_id == lease_id]


# -- finishing in odd orders ---------------------------------------------------------------
def test_finish_before_the_acquire_completes_leaves_nothing_behind(stack: WorkerStack) -> None:
    rt, run_id = stack.runtime(), rid()
    # the sandbox exists, then the provider is slow to answer: the backend gives up first
    stack.faults.write({"acquire": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    pending = producer.acquire_lease(run_id, {"provider": "faulty"})
    lease_id = eventually(lambda: (r := rt.store.get_run(run_id)) and r.lease_id, 30,
                          "the run's lease intent")
    done = producer.finish_run(run_id, "aborted", error="user cancelled").get(60)
    assert done == {"run_id": run_id, "status": "aborted", "change": "changed",
                    "reclaim_enqueued": True}
    # a legitimate race lost, not a wrong request: AcquireCancelled (409), not InvalidRequest
    with pytest.raises(AcquireCancelled, match=f"lease {lease_id} was ended"):
        pending.get(60)
    eventually(lambda: rt.store.get_lease(lease_id).state == LeaseState.DESTROYED, 60,
               "the lease destroyed")
    eventually(lambda: not leftover(rt, "faulty", lease_id), 30, "the sandbox gone")
    run = rt.store.get_run(run_id)
    assert (run.status, run.error, run.lease_id) == (RunStatus.ABORTED, "user cancelled",
                                                     lease_id)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease_id)


def test_a_second_finish_with_another_status_answers_the_first(stack: WorkerStack) -> None:
    rt = stack.runtime()
    run_id, lease_id = acquire()
    first = producer.finish_run(run_id, "completed", 0).get(60)
    assert first["change"] == "changed" and first["reclaim_enqueued"]
    again = by_name("run.finish", run_id=run_id, status="failed", exit_code=9, error="late")
    assert again == {"run_id": run_id, "status": "completed", "change": "unchanged",
                     "reclaim_enqueued": False}
    run = reclaimed(rt, run_id)
    assert (run.status, run.exit_code, run.error) == (RunStatus.COMPLETED, 0, None)
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    truthful(rt, run_id, lease_id)


def test_detach_attach_and_touch_after_the_end_change_nothing(stack: WorkerStack) -> None:
    rt = stack.runtime()
    finished, finished_lease = acquire()
    producer.finish_run(finished, "completed", 0).get(60)
    assert producer.detach_run(finished).get(60)["change"] == "unchanged"
    assert rt.store.get_run(finished).detached_since is None
    gone, gone_lease = acquire()
    assert producer.detach_run(gone).get(60)["change"] == "changed"
    producer.destroy_lease(gone_lease).get(60)
    assert by_name("run.attach", run_id=gone)["change"] == "unchanged"
    run = rt.store.get_run(gone)
    assert run.status == RunStatus.ABORTED and run.error == f"its lease {gone_lease} ended: " \
        "requested"
    events = len(rt.store.events(gone_lease))
    assert producer.touch_lease(gone_lease).get(60) == {
        "lease_id": gone_lease, "touched": False, "idle_deadline_at": None,
        "reason": "the lease is destroyed, not active"}
    assert len(rt.store.events(gone_lease)) == events
    assert rt.store.get_lease(gone_lease).state == LeaseState.DESTROYED
    reclaimed(rt, finished)
    truthful(rt, finished, finished_lease, gone, gone_lease)


def test_reclaim_of_a_run_with_no_lease_is_not_found_and_touches_nothing(
        stack: WorkerStack) -> None:
    rt, key = stack.runtime(), f"sk-taken-{uuid.uuid4().hex[:8]}"
    holder, held = acquire({"sandbox_key": key})
    refused = rid()
    with pytest.raises(InvalidRequest, match="already has a live lease"):
        producer.acquire_lease(refused, {"sandbox_key": key}).get(60)
    done = producer.reclaim_run(refused).get(60)
    assert done == {"run_id": refused, "outcome": "not-found", "lease_id": None,
                    "detail": "the run has no lease"}
    assert rt.store.get_run(refused).reclaim_outcome == ReclaimOutcome.NOT_FOUND
    assert rt.store.get_lease(held).state == LeaseState.ACTIVE
    with pytest.raises(NotFound, match="nothing to reclaim"):
        producer.reclaim_run(rid("ghost")).get(60)
    producer.finish_run(holder, "completed", 0).get(60)
    assert reclaimed(rt, holder).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, holder, held, refused)


@pytest.mark.parametrize("newest_first", [True, False])
def test_a_reuse_thread_finished_in_any_order_keeps_its_sandbox_for_the_next_run(
        stack: WorkerStack, newest_first: bool) -> None:
    rt, thread = stack.runtime(), f"th-{uuid.uuid4().hex[:8]}"
    spec = {"thread_id": thread, "reuse": True}
    first, lease_id = acquire(spec)
    second, shared = acquire(spec)
    assert shared == lease_id
    for run_id in ([second, first] if newest_first else [first, second]):
        done = producer.finish_run(run_id, "completed", 0).get(60)
        assert done["change"] == "changed" and not done["reclaim_enqueued"]
        assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE
    third, again = acquire(spec)
    assert again == lease_id
    assert producer.touch_lease(lease_id).get(60)["touched"]
    assert producer.reclaim_run(first).get(60)["detail"] == f"sandbox still serves run {third}"
    producer.destroy_lease(lease_id).get(60)
    statuses = [rt.store.get_run(r).status for r in (first, second, third)]
    assert statuses == [RunStatus.COMPLETED, RunStatus.COMPLETED, RunStatus.ABORTED]
    assert not leftover(rt, "local", lease_id)
    truthful(rt, first, second, third, lease_id)


def test_a_run_finished_while_its_reuse_acquire_checks_the_sandbox_is_not_bound(
        stack: WorkerStack) -> None:
    # Before: the acquire bound the finished run anyway and answered "reused"; the lease
    # named a finished run as its run while the thread's first run still used it.
    rt, thread = stack.runtime(), f"th-{uuid.uuid4().hex[:8]}"
    spec = {"thread_id": thread, "reuse": True, "provider": "faulty"}
    first, lease_id = acquire(spec)
    stack.faults.write({"resume_check": [{"fault": "slow", "seconds": 3}]})
    second = rid()
    pending = producer.acquire_lease(second, spec)
    eventually(lambda: rt.store.get_run(second), 30, "the second run recorded")
    assert producer.finish_run(second, "aborted", error="user cancelled").get(60)[
        "change"] == "changed"
    with pytest.raises(InvalidRequest, match=f"run {second} is aborted; start a new run"):
        pending.get(60)
    run = rt.store.get_run(second)
    assert (run.status, run.lease_id, run.error) == (RunStatus.ABORTED, None, "user cancelled")
    lease = rt.store.get_lease(lease_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, first)
    assert reclaimed(rt, second).reclaim_outcome == ReclaimOutcome.NOT_FOUND
    producer.finish_run(first, "completed", 0).get(60)
    producer.destroy_lease(lease_id).get(60)
    assert not leftover(rt, "faulty", lease_id)
    truthful(rt, first, second, lease_id)


# -- payloads a backend gets wrong -------------------------------------------------------
@pytest.mark.parametrize(("name", "fields", "says"), [
    ("run.finish", {"status": "done"}, "status must be one of"),
    ("run.finish", {"exit_code": "0"}, "exit_code must be an integer"),
    ("run.finish", {"exit_code": 1.5}, "exit_code must be an integer"),
    ("run.finish", {"error": {"msg": "x"}}, "error must be a string or null"),
    ("run.finish", {"status": None}, "status must be one of"),
    ("run.finish", {"reason": "x"}, "unknown field(s) 'reason'"),
    ("run.detach", {"status": "completed"}, "unknown field(s) 'status'"),
    ("run.attach", {"run_id": ["x"]}, "run_id"),
])
def test_malformed_payloads_by_name_are_refused_and_change_nothing(
        stack: WorkerStack, name: str, fields: dict[str, Any], says: str) -> None:
    rt = stack.runtime()
    run_id, lease_id = acquire()
    payload = {"run_id": run_id, **({"status": "completed"} if name == "run.finish" else {}),
               **fields}
    with pytest.raises(InvalidRequest, match=f"invalid {name} payload") as err:
        by_name(name, **payload)
    assert says in str(err.value)
    run = rt.store.get_run(run_id)
    assert (run.status, run.error, run.detached_since) == (RunStatus.RUNNING, None, None)
    assert rt.store.get_lease(lease_id).state == LeaseState.ACTIVE
    producer.destroy_lease(lease_id).get(60)


def test_a_finish_without_a_status_or_with_positional_arguments_is_refused(
        stack: WorkerStack) -> None:
    rt = stack.runtime()
    run_id, lease_id = acquire()
    with pytest.raises(InvalidRequest, match=r"missing field\(s\) status"):
        by_name("run.finish", run_id=run_id)
    with pytest.raises(InvalidRequest, match="positional argument"):
        app.send_task("run.finish", args=[run_id, "completed"]).get(60)
    with pytest.raises(InvalidRequest, match=r"invalid lease\.touch payload"):
        by_name("lease.touch", lease_id="../etc")
    assert rt.store.get_run(run_id).status == RunStatus.RUNNING
    producer.destroy_lease(lease_id).get(60)


@pytest.mark.parametrize(("sent", "stored"), ids=["nul", "lone-surrogate"], argvalues=[
    ("segfault\x00 in worker", "segfault\ufffd in worker"),
    ("bad \ud800 text\n\tat line 3", "bad \ufffd text\n\tat line 3"),
])
def test_an_error_no_store_can_hold_still_finishes_the_run(
        stack: WorkerStack, sent: str, stored: str) -> None:
    # Before: PostgreSQL refused the NUL (StoreError) and both stores the lone surrogate
    # (UnicodeEncodeError): the finish failed and the run stayed running.
    rt = stack.runtime()
    run_id, lease_id = acquire()
    done = by_name("run.finish", run_id=run_id, status="failed", exit_code=139, error=sent)
    assert done["change"] == "changed" and done["reclaim_enqueued"]
    run = reclaimed(rt, run_id)
    assert (run.status, run.exit_code, run.error) == (RunStatus.FAILED, 139, stored)
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease_id)


def test_a_huge_error_through_the_producer_still_finishes_the_run(stack: WorkerStack) -> None:
    # Before: the producer sent the whole error; over the payload limit the worker refused
    # the message (InvalidRequest) and the run stayed running. Now it sends as much as the
    # payload limit allows, and the run's note says how long the whole error was.
    rt = stack.runtime()
    run_id, lease_id = acquire()
    huge = "Traceback (most recent call last):\n" + "  frame\n" * 40_000
    assert len(huge.encode()) > rt.settings.max_payload_bytes
    done = producer.finish_run(run_id, "failed", 1, huge).get(60)
    assert done["change"] == "changed"
    run = reclaimed(rt, run_id)
    assert run.status == RunStatus.FAILED and run.error is not None
    assert run.error.startswith("Traceback")
    assert run.error.endswith(f"... [{len(huge)} characters; the rest cut]")
    truthful(rt, run_id, lease_id)


# -- no secret in a run's error ----------------------------------------------------------
SECRET = "tok-" + uuid.uuid4().hex


@pytest.fixture
def one_process_worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[WorkerStack]:
    """A worker of one pool process on a queue of its own: the process that runs the
    acquire (and so learns its secret) is the one that runs the finish. (Each pool process
    knows only the secrets of the messages it ran: see the report on tasks/redaction.py.)"""
    from models.migrate import upgrade

    queue = f"secrets-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url, extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    with sending_to(queue):
        try:
            stack.start_worker(concurrency=1)
            yield stack
        finally:
            stack.stop()


def test_a_secret_in_a_finish_error_is_kept_nowhere(one_process_worker: WorkerStack) -> None:
    stack = one_process_worker
    rt = stack.runtime()
    run_id, lease_id = acquire({"secret_env": {"API_TOKEN": SECRET}})
    head = (f"401 from api with Authorization: Bearer {SECRET}\n"
            f"spec was {{'secret_env': {{'OTHER': 'never-seen-{uuid.uuid4().hex}'}}}}\n")
    shown = ("401 from api with Authorization: Bearer ***\n"
             "spec was {'secret_env': '***' [rest of line withheld]\n")
    # and once where the stored text is cut (were it cut before the scrub, a part of the
    # secret would be kept)
    error = head + "x" * (1950 - len(shown)) + SECRET + " tail" + "y" * 100
    result = by_name("run.finish", run_id=run_id, status="failed", exit_code=1, error=error)
    assert result["change"] == "changed"
    run = reclaimed(rt, run_id)
    assert run.error is not None and run.error.startswith(shown + "xxx")
    assert "never-seen-" not in run.error and SECRET[:8] not in run.error
    assert len(run.error) <= 2000 and run.error.endswith("characters; the rest cut]")
    assert SECRET not in json.dumps(result)
    assert not any(SECRET[:8] in e.reason for e in rt.store.events(lease_id))
    assert SECRET[:8] not in stack.logfile.read_text()
    truthful(rt, run_id, lease_id)
