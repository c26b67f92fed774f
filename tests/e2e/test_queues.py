"""Lanes: each task goes to its installation's lane queue, a worker without -Q serves every
lane (cleanup first), -Q separates them, and a by-name send to the base queue is served."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Iterator

import pytest
import redis

from tasks import producer
from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack, sending_to
from workers.app import TASK_MODULES, app
from workers.queues import POLL_ORDER, Lane, lane_of, queue_name

pytestmark = pytest.mark.timeout(180)
NOOP = {"provider": "noop"}


@pytest.fixture(scope="module")
def lanes_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[WorkerStack]:
    """A worker on an installation queue of its own; this test process sends to it."""
    with own_queue_stack("lanes", redis_server.url, tmp_path_factory.mktemp("lanes")) as stack:
        yield stack


def routed_queue(task_name: str) -> str:
    return str(app.amqp.router.route({}, task_name)["queue"].name)


def test_each_task_goes_to_its_lane_under_the_installation_queue() -> None:
    with sending_to("acme"):
        assert routed_queue("lease.acquire") == "acme.acquire"
        assert routed_queue("lease.resume_check") == "acme.acquire"
        for name in ("lease.destroy", "sandbox.reclaim", "run.finish", "run.detach",
                     "run.attach", "lease.touch"):
            assert routed_queue(name) == "acme.cleanup", name
        assert routed_queue("sweep.expire_leases") == "acme.sweeps"
        assert routed_queue("leasekeeper.ping") == "acme"
        # an explicit queue still wins: a by-name sender may target the base queue
        assert app.amqp.router.route({"queue": "acme"}, "lease.acquire")["queue"].name == "acme"


def test_every_registered_task_has_a_lane() -> None:
    for module in TASK_MODULES:
        importlib.import_module(module)
    # Only leasekeeper's own tasks (plugins such as pytest-celery register shared tasks on
    # every app in the process).
    ours = tuple(f"{m}." for m in TASK_MODULES) + tuple(TASK_MODULES)
    lanes = {name: lane_of(name) for name, task in app.tasks.items()
             if not name.startswith("celery.") and task.__module__.startswith(ours)}
    assert lanes["lease.destroy"] is Lane.CLEANUP and lanes["sweep.orphans"] is Lane.SWEEPS
    assert {name for name, lane in lanes.items() if lane is Lane.DEFAULT} == {"leasekeeper.ping"}


def test_a_worker_without_Q_consumes_every_lane_cleanup_first(lanes_stack: WorkerStack) -> None:
    base = app.conf.task_default_queue
    hostname = lanes_stack.hostname(1)
    active = app.control.inspect(destination=[hostname], timeout=5).active_queues()
    assert active is not None, "the worker did not answer"
    assert [q["name"] for q in active[hostname]] == [queue_name(base, lane)
                                                      for lane in POLL_ORDER]


def test_a_destroy_is_served_before_the_acquires_queued_ahead_of_it(
        lanes_stack: WorkerStack, redis_server: RedisServer) -> None:
    # given a lease, then a backlog of acquires queued before its destroy
    lease_id = producer.acquire_lease(f"first-{uuid.uuid4().hex[:8]}", NOOP).get(60)["lease_id"]
    backlog = [producer.acquire_lease(f"q-{uuid.uuid4().hex[:10]}", NOOP) for _ in range(200)]
    # when the destroy is sent last
    destroyed = producer.destroy_lease(lease_id).get(120)
    done_when_destroyed = sum(r.ready() for r in backlog)
    redis.Redis.from_url(redis_server.url).delete(f"{app.conf.task_default_queue}.acquire")
    # then it did not wait for the backlog (one queue, first come first served, ran all 200
    # acquires first)
    assert destroyed["result"] == "destroyed"
    assert done_when_destroyed < len(backlog) // 2, done_when_destroyed


def test_a_by_name_send_to_the_base_queue_is_served(lanes_stack: WorkerStack) -> None:
    base = app.conf.task_default_queue
    run_id = f"byname-{uuid.uuid4().hex[:8]}"
    result = app.send_task("lease.acquire", kwargs={"run_id": run_id, "spec": NOOP},
                           queue=base).get(60)
    assert result["result"] == "acquired" and result["run_id"] == run_id
    assert app.send_task("lease.destroy", kwargs={"lease_id": result["lease_id"]},
                         queue=base).get(60)["result"] == "destroyed"


def test_Q_gives_a_worker_only_its_lanes(lanes_stack: WorkerStack) -> None:
    base = app.conf.task_default_queue
    cleanup = queue_name(base, Lane.CLEANUP)
    proc = lanes_stack.start_worker(concurrency=1, queues=[cleanup])
    hostname = lanes_stack.hostname(lanes_stack.procs.index(proc) + 1)
    active = app.control.inspect(destination=[hostname], timeout=5).active_queues()
    assert active is not None, "the cleanup worker did not answer"
    assert [q["name"] for q in active[hostname]] == [cleanup]
