"""Races a web backend makes through the broker, with a real Celery worker (prefork, two
processes) and a provider slowed at its seam, on SQLite and PostgreSQL: the same run's
acquire sent twice at once, and a ``run.finish`` sent right behind its acquire. Afterwards
the run and lease records tell the truth and no sandbox is lost or left behind."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from models.invariants import check
from models.schema import LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.base import ResumeOutcome
from providers.errors import InvalidRequest
from tasks import producer
from tasks.leases import handle
from tests.e2e.conftest import eventually
from tests.pools.conftest import warm
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def rid(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def truthful(rt: Runtime, *ids: str) -> None:
    found = [v.describe() for v in check(rt.store, utcnow(), rt.settings.claim_timeout_s)
             if v.run_id in ids or v.lease_id in ids]
    assert found == []


def reclaimed(rt: Runtime, run_id: str) -> Any:
    return eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                      60, f"the reclaim of {run_id}")


def test_the_same_acquire_sent_twice_at_once_keeps_the_sandbox(stack: WorkerStack) -> None:
    # Before: the copy whose provider call was slower found the lease active (the other
    # copy had adopted its sandbox and activated it), took that for "ended meanwhile" and
    # destroyed the run's sandbox.
    rt, run_id = stack.runtime(), rid()
    stack.faults.write({"acquire": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    spec = {"provider": "faulty"}
    copies = [producer.acquire_lease(run_id, spec), producer.acquire_lease(run_id, spec)]
    answers = [c.get(60) for c in copies]
    assert sorted(a["result"] for a in answers)[0] in {"acquired", "adopted"}
    assert sorted(a["result"] for a in answers)[1] == "already_acquired"
    lease_id = answers[0]["lease_id"]
    assert answers[1]["lease_id"] == lease_id
    lease, run = rt.store.get_lease(lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id) == (RunStatus.RUNNING, lease_id)
    assert rt.provider("faulty").resume_check(handle(lease), 5).outcome == \
        ResumeOutcome.RESUMABLE
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease_id)


def test_the_same_run_acquired_again_with_another_spec_is_refused_not_answered(
        stack: WorkerStack) -> None:
    # Before: the second acquire was answered already_acquired with the first spec's
    # sandbox, and the backend believed its run had the sandbox it asked for.
    rt, run_id = stack.runtime(), rid()
    spec = {"env": {"MODE": "a"}, "secret_env": {"TOKEN": "tok-a1"}}
    first = producer.acquire_lease(run_id, spec).get(60)
    other = {"env": {"MODE": "b"}, "secret_env": {"KEY": "tok-b2"}, "ttl_s": 600}
    with pytest.raises(InvalidRequest) as refused:
        producer.acquire_lease(run_id, other).get(60)
    message = str(refused.value)
    assert f"run {run_id} already has lease {first['lease_id']} (active)" in message
    assert "(differing fields: env, secret_env, ttl_s)" in message
    assert "start a new run" in message and "tok-" not in message
    again = producer.acquire_lease(run_id, spec).get(60)  # a redelivery: as before
    assert (again["result"], again["lease_id"]) == ("already_acquired", first["lease_id"])
    lease, run = rt.store.get_lease(first["lease_id"]), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id, run.error) == (RunStatus.RUNNING, lease.lease_id, None)
    assert rt.provider("local").resume_check(handle(lease), 5).outcome == \
        ResumeOutcome.RESUMABLE
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease.lease_id)


def test_two_copies_of_a_run_with_different_specs_at_once_give_it_one_sandbox(
        stack: WorkerStack) -> None:
    # The copy that comes second (its provider call slowed) is refused, whichever it is.
    rt, run_id = stack.runtime(), rid()
    stack.faults.write({"acquire": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    copies = [producer.acquire_lease(run_id, {"provider": "faulty", "env": {"MODE": m}})
              for m in ("a", "b")]
    answers: list[dict[str, Any] | str] = []
    for copy in copies:
        try:
            answers.append(copy.get(60))
        except InvalidRequest as exc:
            answers.append(str(exc))
    (won,) = [a for a in answers if isinstance(a, dict)]
    (lost,) = [a for a in answers if isinstance(a, str)]
    assert won["result"] in {"acquired", "adopted"}
    assert f"already has lease {won['lease_id']}" in lost and "(differing fields: env)" in lost
    lease, run = rt.store.get_lease(won["lease_id"]), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id) == (RunStatus.RUNNING, lease.lease_id)
    assert [x.lease_id for x in rt.store.leases() if x.run_id == run_id] == [lease.lease_id]
    assert [r.lease_id for r in rt.provider("faulty").list_managed()
            if r.lease_id == lease.lease_id] == [lease.lease_id]  # one sandbox, not two
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, lease.lease_id)


@pytest.fixture(scope="module")
def pool_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[WorkerStack]:
    """A worker on a queue and SQLite store of its own, with a one-member pool of the
    faulty provider (so its claims can be slowed)."""
    from tests.pools.conftest import WAITING_MEMBER, destroy_everything

    pools = [{"name": "slowclaim", "provider": "faulty", "size": 1,
              "template": {"command": WAITING_MEMBER}}]
    with own_queue_stack("races", redis_server.url, tmp_path_factory.mktemp("races"),
                         {"LEASEKEEPER_POOLS": json.dumps(pools)}) as stack:
        try:
            yield stack
        finally:
            stack.stop()
            destroy_everything(stack.runtime())


def test_the_same_pool_claim_sent_twice_at_once_answers_already_acquired(
        pool_stack: WorkerStack) -> None:
    # Before: the copy whose claim was slower found the member active for its own run and
    # failed with "was ended (active) while it was being claimed".
    rt, run_id = pool_stack.runtime(), rid()
    pool_stack.faults.write({})
    app.send_task("sweep.fill_pools").get(60)
    member = eventually(lambda: next(iter(warm(rt, "slowclaim")), None), 60, "a warm member")
    pool_stack.faults.write({"claim": [{"fault": "slow", "seconds": 3, "when": "after"}]})
    spec = {"pool": "slowclaim"}
    copies = [producer.acquire_lease(run_id, spec), producer.acquire_lease(run_id, spec)]
    answers = sorted((c.get(60) for c in copies), key=lambda a: str(a["result"]))
    assert [a["result"] for a in answers] == ["already_acquired", "claimed"]
    assert {a["lease_id"] for a in answers} == {member.lease_id}
    lease, run = rt.store.get_lease(member.lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.run_id) == (LeaseState.ACTIVE, run_id)
    assert (run.status, run.lease_id) == (RunStatus.RUNNING, member.lease_id)
    assert rt.provider("faulty").resume_check(handle(lease), 5).outcome == \
        ResumeOutcome.RESUMABLE
    producer.finish_run(run_id, "completed", 0).get(60)
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, member.lease_id)


@pytest.fixture(scope="module")
def patient_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[WorkerStack]:
    """A worker on a queue and SQLite store of its own whose retries span well over 30 s
    (a run.finish waiting for its run must still be retrying when the acquire comes)."""
    with own_queue_stack("finish-first", redis_server.url,
                         tmp_path_factory.mktemp("finish-first"),
                         {"LEASEKEEPER_TASK_MAX_RETRIES": "40",
                          "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "1",
                          "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "2"}) as stack:
        yield stack


def test_a_finish_run_before_its_acquire_records_the_run_lands_after_it(
        patient_stack: WorkerStack) -> None:
    # Before: the finish failed NotFound at once (lost), and the acquire then made a
    # sandbox for a run its backend had cancelled.
    rt, run_id = patient_stack.runtime(), rid()
    finish = producer.finish_run(run_id, "aborted", error="user cancelled")
    # the cleanup lane ran it first: wait until the worker has taken it
    eventually(lambda: finish.state not in {"PENDING", "STARTED"}, 60, "the finish taken")
    pending = producer.acquire_lease(run_id, {})
    done = finish.get(90)
    assert (done["status"], done["change"], done["reclaim_enqueued"]) == (
        "aborted", "changed", True)
    with contextlib.suppress(InvalidRequest):  # the finish may land before the sandbox
        pending.get(60)
    run = rt.store.get_run(run_id)
    assert (run.status, run.error) == (RunStatus.ABORTED, "user cancelled")
    assert run.lease_id is not None
    eventually(lambda: rt.store.get_lease(run.lease_id).state == LeaseState.DESTROYED, 60,
               "the cancelled run's lease destroyed")
    eventually(lambda: not [r for r in rt.provider("local").list_managed()
                            if r.lease_id == run.lease_id], 30, "its sandbox gone")
    assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
    truthful(rt, run_id, run.lease_id)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("run.finish", {"run_id": "RID\n", "status": "completed"}),
    ("lease.acquire", {"run_id": "RID", "spec": {"labels": {"team": "a\n"}}}),
    ("lease.acquire", {"run_id": "RID", "spec": {"tenant": "acme\n"}}),
])
def test_a_payload_by_name_with_a_trailing_newline_is_refused_by_the_worker(
        stack: WorkerStack, name: str, kwargs: dict[str, Any]) -> None:
    rt, run_id = stack.runtime(), rid()
    sent = {**kwargs, "run_id": kwargs["run_id"].replace("RID", run_id)}
    with pytest.raises(InvalidRequest, match=f"invalid {name} payload"):
        app.send_task(name, kwargs=sent).get(60)
    assert rt.store.get_run(run_id) is None and rt.store.get_run(f"{run_id}\n") is None


# -- destroy reasons a backend sends --------------------------------------------------------
@pytest.mark.parametrize(("reason", "recorded"), [
    ("user\x00left", "user\N{REPLACEMENT CHARACTER}left"),
    ("bad \ud800 text", "bad \N{REPLACEMENT CHARACTER} text"),
    ("   ", "requested"),
    ("", "requested"),
    ("x" * 5000, "x" * 64),
])
def test_a_destroy_reason_the_store_cannot_hold_still_destroys(
        stack: WorkerStack, reason: str, recorded: str) -> None:
    # Before: NUL or a lone surrogate failed the destroy at the store and the lease stayed
    # active; a blank reason made the run's error "its lease X ended: ".
    rt, run_id = stack.runtime(), rid()
    lease_id = producer.acquire_lease(run_id, {}).get(60)["lease_id"]
    done = app.send_task("lease.destroy", kwargs={"lease_id": lease_id, "reason": reason}
                         ).get(60)
    assert (done["result"], done["state"]) == ("destroyed", "destroyed")
    lease, run = rt.store.get_lease(lease_id), rt.store.get_run(run_id)
    assert (lease.state, lease.end_reason) == (LeaseState.DESTROYED, recorded)
    assert (run.status, run.error) == (RunStatus.ABORTED,
                                       f"its lease {lease_id} ended: {recorded}")
    assert not [r for r in rt.provider("local").list_managed() if r.lease_id == lease_id]
    truthful(rt, run_id, lease_id)


def running_sandboxes(rt: Runtime, name: str) -> list[Any]:
    """The faulty (local) provider's resources named ``name`` whose process still runs."""
    return [r for r in rt.provider("faulty").list_managed()
            if r.name == name and r.meta.get("alive")]


@pytest.mark.parametrize("ender", ["destroy", "reclaim"])
def test_a_lease_ended_while_provisioning_leaves_no_sandbox_running(
        stack: WorkerStack, ender: str) -> None:
    # Before: the destroy's provider call ran before the sandbox existed (already_gone), the
    # acquire then made it, found the lease destroying and left it to that destroy: the
    # lease said destroyed (the reclaim too) while `sleep 302` ran on until sweep.orphans.
    # And the acquire failed with InvalidRequest, as if its request had been wrong.
    rt, run_id = stack.runtime(), rid()
    stack.faults.write({
        "acquire": [{"fault": "slow", "seconds": 6, "when": "before", "times": 1}],
        "destroy": [{"fault": "slow", "seconds": 10, "when": "after", "times": 1}]})
    try:
        sent = producer.acquire_lease(run_id, {"provider": "faulty",
                                               "command": ["sleep", "302"]})
        lease = eventually(lambda: (r := rt.store.get_run(run_id)) and r.lease_id and
                           rt.store.get_lease(r.lease_id), 60, "the acquire's intent")
        assert lease.state == LeaseState.PROVISIONING
        if ender == "destroy":
            ended = producer.destroy_lease(lease.lease_id)
        else:
            ended = producer.finish_run(run_id, "completed", 0)
        with pytest.raises(producer.AcquireCancelled,
                           match=f"lease {lease.lease_id} was ended \\(destroying\\) while "
                                 "it was being provisioned"):
            sent.get(60)
        status = producer.task_status(sent.id)
        assert status.state == "FAILURE" and "acquire-cancelled" in (status.error or "")
        ended.get(60)
        if ender == "reclaim":
            assert reclaimed(rt, run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
        final = eventually(lambda: (got := rt.store.get_lease(lease.lease_id)).state !=
                           LeaseState.DESTROYING and got, 60, "the destroy's end")
        assert final.state == LeaseState.DESTROYED
        assert running_sandboxes(rt, lease.provider_lease_id) == []
        truthful(rt, run_id, lease.lease_id)
    finally:
        stack.faults.write({})
        run = rt.store.get_run(run_id)
        if run is not None and run.lease_id:  # what a failing run left: not for the next test
            rt.provider("faulty").destroy(handle(rt.store.get_lease(run.lease_id)))


def test_a_lease_ended_while_provisioning_whose_sandbox_will_not_go_stays_pending_cleanup(
        stack: WorkerStack) -> None:
    # The acquire's own destroy of what it made fails: the lease must not end destroyed
    # (the overlapping destroy's final move is refused) but pending_cleanup, retried.
    rt, run_id = stack.runtime(), rid()
    stack.faults.write({
        "acquire": [{"fault": "slow", "seconds": 6, "when": "before", "times": 1}],
        # the overlapping destroy takes the first two (rules match by "when"), the
        # acquire's own destroy of what it made the third
        "destroy": [{"fault": "slow", "seconds": 0, "when": "before", "times": 1},
                    {"fault": "slow", "seconds": 10, "when": "after", "times": 1},
                    {"fault": "terminal", "when": "before", "times": 1}]})
    try:
        sent = producer.acquire_lease(run_id, {"provider": "faulty",
                                               "command": ["sleep", "302"]})
        lease = eventually(lambda: (r := rt.store.get_run(run_id)) and r.lease_id and
                           rt.store.get_lease(r.lease_id), 60, "the acquire's intent")
        ended = producer.destroy_lease(lease.lease_id)
        with pytest.raises(producer.AcquireCancelled):
            sent.get(60)
        with pytest.raises(Exception, match="could not be destroyed"):
            ended.get(60)
        left = rt.store.get_lease(lease.lease_id)
        assert left.state == LeaseState.PENDING_CLEANUP
        assert running_sandboxes(rt, lease.provider_lease_id) != []
        truthful(rt, run_id, lease.lease_id)
        assert producer.destroy_lease(lease.lease_id).get(60)["result"] == "destroyed"
        assert running_sandboxes(rt, lease.provider_lease_id) == []
    finally:
        stack.faults.write({})
        run = rt.store.get_run(run_id)
        if run is not None and run.lease_id:
            rt.provider("faulty").destroy(handle(rt.store.get_lease(run.lease_id)))
