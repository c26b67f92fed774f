"""docker-compose.yml brought up for real (with only tests/compose/docker-compose.test.yml's
local images, host networking and free ports) and checked the way a user would: the
migration, health checks, Flower, a lease through the compose worker from a producer
outside the stack, a worker restart mid-acquire, down/up keeping the store, and stop.

The tests share one stack (module scope) and run in file order.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from models.schema import LeaseState
from tests.compose.stack import FLOWER_AUTH, ComposeStack
from tests.e2e.conftest import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _lease_state(stack: ComposeStack, lease_id: str) -> str:
    return stack.store.get_lease(lease_id).state


def _acquire(stack: ComposeStack, run_id: str, **spec: Any) -> dict[str, Any]:
    result: dict[str, Any] = stack.send("lease.acquire", run_id=run_id, spec=spec).get(
        timeout=180)
    assert result["state"] == "active", result
    return result


def _docker_time(value: str) -> datetime:
    """Docker's RFC 3339 times carry nanoseconds; datetime takes microseconds."""
    whole, _, fraction = value.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction or '0')[:6]:0<6}+00:00")


def _alive_in(stack: ComposeStack, pid: int) -> bool:
    return stack.exec("worker", "sh", "-c", f"kill -0 {pid}").returncode == 0


def test_migrate_ran_once_and_exited_0(compose_stack: ComposeStack) -> None:
    assert len(compose_stack.container_ids("migrate")) == 1  # one container, one run
    state = compose_stack.inspect("migrate")["State"]
    assert not state["Running"] and state["ExitCode"] == 0, compose_stack.logs("migrate")
    assert compose_stack.inspect("migrate")["RestartCount"] == 0
    for service in ("worker", "beat", "flower"):  # they wait for it to complete
        started = _docker_time(compose_stack.inspect(service)["State"]["StartedAt"])
        assert started > _docker_time(state["FinishedAt"]), service
    # The schema is there (the worker's store queries work) and at the head revision.
    assert compose_stack.store.leases() == []


def test_worker_and_beat_are_healthy_and_the_worker_check_really_pings(
        compose_stack: ComposeStack) -> None:
    assert compose_stack.health("worker") == "healthy"
    assert compose_stack.health("beat") == "healthy"
    # A worker that cannot answer (its main process frozen) fails its health check.
    main = _celery_main_pid(compose_stack, "worker")
    os.kill(main, signal.SIGSTOP)
    try:
        assert compose_stack.run_healthcheck("worker") != 0
    finally:
        os.kill(main, signal.SIGCONT)
    assert compose_stack.run_healthcheck("worker") == 0


def _celery_main_pid(stack: ComposeStack, service: str) -> int:
    """The host pid of the service's celery main process (the init's child)."""
    init = int(stack.inspect(service)["State"]["Pid"])
    for pid in stack.host_pids(service):
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == init and b"celery" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no celery process under the init ({init}) of {service}")


def test_a_lease_is_acquired_and_reclaimed_through_the_compose_worker(
        compose_stack: ComposeStack) -> None:
    acquired = _acquire(compose_stack, "compose-run-1", tenant="acme")
    pid = int(compose_stack.store.get_lease(acquired["lease_id"]).provider_meta["pid"])
    assert _alive_in(compose_stack, pid)  # the sandbox runs inside the worker container

    finished = compose_stack.send("run.finish", run_id="compose-run-1", status="completed",
                                  exit_code=0).get(timeout=120)
    assert finished["reclaim_enqueued"] is True
    eventually(lambda: _lease_state(compose_stack, acquired["lease_id"]) == LeaseState.DESTROYED,
               120, "the reclaimed lease to be destroyed")
    assert not _alive_in(compose_stack, pid)
    run = compose_stack.store.get_run("compose-run-1")
    assert run is not None and run.status == "completed"


def _flower(stack: ComposeStack, path: str, auth: tuple[str, str] | None) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{stack.flower_port}{path}")
    if auth:
        token = base64.b64encode(":".join(auth).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_flower_refuses_no_auth_and_shows_the_lifecycle_tasks(
        compose_stack: ComposeStack) -> None:
    eventually(lambda: _flower_answers(compose_stack), 120, "Flower to answer")
    compose_stack.wait_healthy("flower")  # its compose health check passes too
    for auth in (None, ("ops", "wrong")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            _flower(compose_stack, "/api/tasks", auth)
        assert refused.value.code == 401

    def names() -> set[str] | None:
        tasks = _flower(compose_stack, "/api/tasks", FLOWER_AUTH)
        seen = {str(t["name"]) for t in tasks.values()}
        # beat's every-30-s finish_exited, by name: another sweep (fill_pools) may come first
        wanted = {"lease.acquire", "run.finish", "sandbox.reclaim", "sweep.finish_exited"}
        return seen if wanted <= seen else None

    # Flower only sees events sent after it started: drive one more lease through.
    acquired = _acquire(compose_stack, "compose-run-flower")
    compose_stack.send("run.finish", run_id="compose-run-flower", status="completed",
                       exit_code=0).get(timeout=120)
    seen = eventually(names, 180, "Flower to list the lifecycle tasks and a beat sweep")
    assert "sweep.finish_exited" in seen  # beat's every-30-s sweep, run by the worker
    eventually(lambda: _lease_state(compose_stack, acquired["lease_id"]) == LeaseState.DESTROYED,
               120, "the second lease to be reclaimed")


def test_metrics_and_console_serve_and_the_console_refuses_no_auth(
        compose_stack: ComposeStack) -> None:
    def scrape() -> str | None:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{compose_stack.metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return None
        return text if "leasekeeper_leases" in text else None

    metrics = eventually(scrape, 180, "the compose exporter to serve lease metrics")
    assert "leasekeeper_lease_transitions" in metrics
    console = f"http://127.0.0.1:{compose_stack.console_port}/"

    def refused() -> int | None:
        try:
            urllib.request.urlopen(console, timeout=10)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, ConnectionError):
            return None
        return 200

    assert eventually(refused, 180, "the compose console to answer") == 401
    token = base64.b64encode(":".join(FLOWER_AUTH).encode()).decode()
    request = urllib.request.Request(console, headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(request, timeout=10) as page:
        assert page.status == 200 and "lease" in page.read().decode().lower()


def _flower_answers(stack: ComposeStack) -> bool:
    try:
        _flower(stack, "/api/workers", FLOWER_AUTH)
    except (urllib.error.URLError, ConnectionError):
        return False
    return True


def test_restarting_the_worker_mid_acquire_loses_nothing(compose_stack: ComposeStack) -> None:
    count = 12
    results = [compose_stack.send("lease.acquire", run_id=f"compose-restart-{i}", spec={})
               for i in range(count)]

    def some_but_not_all_active() -> bool:
        states = [lease.state for lease in compose_stack.store.leases()
                  if (lease.run_id or "").startswith("compose-restart-")]
        return 0 < states.count(LeaseState.ACTIVE) < count

    eventually(some_but_not_all_active, 120, "the first acquires to finish")
    compose_stack.compose("restart", "worker")
    compose_stack.wait_healthy("worker")

    outcomes = [r.get(timeout=300) for r in results]  # every acquire answered
    assert {o["state"] for o in outcomes} == {"active"}
    leases = [lease for lease in compose_stack.store.leases()
              if (lease.run_id or "").startswith("compose-restart-")]
    assert sorted(lease.run_id for lease in leases) == sorted(
        f"compose-restart-{i}" for i in range(count))  # one lease per run, none twice
    assert {lease.state for lease in leases} == {LeaseState.ACTIVE}
    # Sandboxes started before the restart died with the container; destroying every
    # lease still succeeds (not-found is success) and leaves nothing behind.
    for lease in leases:
        done = compose_stack.send("lease.destroy", lease_id=lease.lease_id).get(timeout=120)
        assert done["state"] == "destroyed", done


def test_down_then_up_keeps_the_store(compose_stack: ComposeStack) -> None:
    before = {lease.lease_id: lease.state for lease in compose_stack.store.leases()}
    assert before
    compose_stack.store.dispose()
    compose_stack.down(volumes=False)
    assert compose_stack.container_ids("worker") == []
    compose_stack.up()
    assert compose_stack.inspect("migrate")["State"]["ExitCode"] == 0  # an idempotent rerun
    after = {lease.lease_id: lease.state for lease in compose_stack.store.leases()}
    assert after == before
    _acquire(compose_stack, "compose-after-up")  # and the new stack works


def test_stop_stops_every_sandbox_and_lets_the_running_task_finish(
        compose_stack: ComposeStack) -> None:
    idle = _acquire(compose_stack, "compose-stop-idle")
    stubborn = _acquire(compose_stack, "compose-stop-stubborn",
                        command=["sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
    sandbox_pids = [int(compose_stack.store.get_lease(a["lease_id"]).provider_meta["pid"])
                    for a in (idle, stubborn)]
    assert all(_alive_in(compose_stack, pid) for pid in sandbox_pids)
    host_pids = compose_stack.host_pids("worker")

    # A destroy of a sandbox ignoring SIGTERM takes the provider's grace (5 s) before its
    # SIGKILL: stop the worker while that task runs.
    destroying = compose_stack.send("lease.destroy", lease_id=stubborn["lease_id"])
    eventually(lambda: _lease_state(compose_stack, stubborn["lease_id"])
               == LeaseState.DESTROYING, 60, "the destroy to start")
    compose_stack.compose("stop", "worker")

    state = compose_stack.inspect("worker")["State"]
    assert not state["Running"]
    assert state["ExitCode"] == 0, "the worker was killed, not shut down within its grace"
    assert destroying.get(timeout=60)["state"] == "destroyed"  # it finished, within grace
    assert _lease_state(compose_stack, stubborn["lease_id"]) == LeaseState.DESTROYED
    left = [pid for pid in host_pids if Path(f"/proc/{pid}").exists()]
    assert left == [], f"processes of the stopped worker container still run: {left}"
