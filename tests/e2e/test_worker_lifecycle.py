"""The whole lifecycle through the real broker and a real Celery worker subprocess, on
SQLite and PostgreSQL: what a web backend sees, and what it must never see."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from models.schema import LeaseState, ReclaimOutcome, RunStatus
from providers.errors import InvalidRequest, TerminalProviderError
from providers.spec import SandboxSpec
from tasks import producer
from tests.e2e.conftest import eventually
from tests.services import free_port, wait_for_port
from tests.stack import WorkerStack
from workers.app import app

pytestmark = pytest.mark.timeout(120)
SECRET = "s3cr3t-" + uuid.uuid4().hex


def rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def lease_state(stack: WorkerStack, lease_id: str) -> str:
    return stack.runtime().store.get_lease(lease_id).state


def test_acquire_resume_finish_reclaim(stack: WorkerStack) -> None:
    run_id = rid()
    acquired = producer.acquire_lease(run_id, {"tenant": "acme", "env": {"A": "1"}}).get(60)
    assert acquired["result"] == "acquired" and acquired["state"] == "active"
    lease_id = acquired["lease_id"]
    checked = producer.check_resumable(lease_id).get(30)
    assert checked["resumable"] is True and checked["details"]["pid"] > 0
    finished = producer.finish_run(run_id, "completed", 0).get(30)
    assert finished["reclaim_enqueued"] is True
    rt = stack.runtime()
    run = eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                     what="the reclaim")
    assert run.reclaim_outcome == ReclaimOutcome.DESTROYED and run.status == RunStatus.COMPLETED
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED
    assert rt.provider("local").list_managed() == []


def test_transient_provider_error_is_retried_to_success(stack: WorkerStack) -> None:
    stack.faults.write({"acquire": [{"fault": "transient", "when": "after", "times": 2}]})
    run_id = rid()
    result = producer.acquire_lease(run_id, {"provider": "faulty"}).get(60)
    assert result["result"] == "adopted"  # the retry took over what the first try made
    leases = [lease for lease in stack.runtime().store.leases() if lease.run_id == run_id]
    assert len(leases) == 1 and leases[0].state == LeaseState.ACTIVE
    producer.destroy_lease(result["lease_id"]).get(30)


def test_terminal_provider_error_fails_at_once_with_the_reason(stack: WorkerStack) -> None:
    stack.faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 1}]})
    run_id = rid()
    async_result = producer.acquire_lease(run_id, {"provider": "faulty"})
    with pytest.raises(TerminalProviderError, match="injected terminal fault"):
        async_result.get(60)
    (lease,) = [lease for lease in stack.runtime().store.leases() if lease.run_id == run_id]
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_failed"


def test_malformed_payload_sent_by_name_fails_clearly_and_writes_nothing(
    stack: WorkerStack,
) -> None:
    run_id = rid()
    bad = app.send_task("lease.acquire", kwargs={"run_id": run_id,
                                                 "spec": {"tenant": "NOT OK", "colour": 1}})
    with pytest.raises(InvalidRequest, match=r"invalid lease\.acquire payload") as err:
        bad.get(30)
    assert "tenant" in str(err.value) and "colour" in str(err.value)
    assert stack.runtime().store.get_run(run_id) is None


def test_nulls_in_a_spec_are_the_defaults_by_name_and_through_the_producer(
    stack: WorkerStack,
) -> None:
    # a JSON client that serialises every absent optional as null (before, tenant, reuse,
    # env, secret_env and labels null were refused with pydantic's text: a QA pass)
    run_id = rid()
    nulls = {**dict.fromkeys(SandboxSpec.model_fields), "provider": "noop"}
    first = app.send_task("lease.acquire", kwargs={"run_id": run_id, "spec": nulls}).get(60)
    assert first["result"] == "acquired"
    # the same spec without the nulls, by name and through the producer: the same spec
    again = app.send_task("lease.acquire",
                          kwargs={"run_id": run_id, "spec": {"provider": "noop"}}).get(60)
    assert (again["result"], again["lease_id"]) == ("already_acquired", first["lease_id"])
    again = producer.acquire_lease(run_id, nulls).get(60)
    assert (again["result"], again["lease_id"]) == ("already_acquired", first["lease_id"])
    assert stack.runtime().store.get_lease(first["lease_id"]).spec == SandboxSpec(
        provider="noop").redacted()
    producer.destroy_lease(first["lease_id"], reason=None).get(30)


def test_a_provider_the_worker_does_not_enable_is_named_as_such(stack: WorkerStack) -> None:
    # the stack's workers enable local, noop and faulty; kubernetes is a provider
    # leasekeeper has (before: "unknown provider 'kubernetes'": a QA pass)
    run_id = rid()
    sent = app.send_task("lease.acquire",
                         kwargs={"run_id": run_id, "spec": {"provider": "kubernetes"}})
    with pytest.raises(InvalidRequest, match=r"provider 'kubernetes' is not enabled on this "
                       r"worker \(it enables local, noop, faulty\): add it to "
                       r"LEASEKEEPER_PROVIDERS to use it"):
        sent.get(30)
    assert stack.runtime().store.get_run(run_id) is None
    with pytest.raises(InvalidRequest, match=r"provider 'kubernetes' is not enabled on this "
                       r"process .*LEASEKEEPER_PROVIDERS, here and on the workers"):
        producer.acquire_lease(run_id, {"provider": "kubernetes"})


def test_producer_validates_before_enqueueing() -> None:
    with pytest.raises(InvalidRequest, match="unknown provider 'gcp'"):
        producer.acquire_lease("run-x", {"provider": "gcp"})
    with pytest.raises(InvalidRequest, match="status must be one of"):
        producer.finish_run("run-x", "done")
    with pytest.raises(InvalidRequest, match="lease_id must be"):
        producer.destroy_lease("../etc")
    with pytest.raises(InvalidRequest, match="reason must be a string or null; got int"):
        producer.destroy_lease("lease-1", reason=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="error must be a string or null"):
        producer.finish_run("run-x", "failed", error={"x": 1})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="exit_code must be an integer from"):
        producer.finish_run("run-x", "failed", exit_code=2**63)


def test_a_repeated_finish_says_how_the_run_did_finish(stack: WorkerStack) -> None:
    run_id = rid()
    producer.acquire_lease(run_id, {"provider": "noop"}).get(30)
    first = producer.finish_run(run_id, "completed", 0).get(30)
    assert (first["status"], first["change"]) == ("completed", "changed")
    again = producer.finish_run(run_id, "failed", 1).get(30)
    assert (again["status"], again["change"]) == ("completed", "unchanged")


def test_worker_killed_mid_acquire_leaves_one_sandbox_and_no_stuck_lease(
    stack: WorkerStack,
) -> None:
    # The pool process is SIGKILLed right after the sandbox was created; acks_late and
    # reject_on_worker_lost redeliver the task, and the retry adopts the sandbox.
    stack.faults.write({"acquire": [{"fault": "kill_worker", "when": "after", "times": 1}]})
    run_id = rid()
    result = producer.acquire_lease(run_id, {"provider": "faulty"}).get(90)
    assert result["result"] == "adopted"
    rt = stack.runtime()
    states = [lease.state for lease in rt.store.leases() if lease.run_id == run_id]
    assert states == [LeaseState.ACTIVE]
    mine = [r for r in rt.provider("faulty").list_managed() if r.lease_id == result["lease_id"]]
    assert len(mine) == 1 and mine[0].meta["alive"]
    producer.destroy_lease(result["lease_id"]).get(30)
    assert not [r for r in rt.provider("faulty").list_managed()
                if r.lease_id == result["lease_id"]]


def test_detached_run_is_reaped_by_the_sweep(stack: WorkerStack) -> None:
    run_id = rid()
    lease_id = producer.acquire_lease(run_id).get(60)["lease_id"]
    producer.detach_run(run_id).get(30)
    rt = stack.runtime()
    eventually(lambda: app.send_task("sweep.reap_runs").get(30)["aborted_detached"] >= 1
               or rt.store.get_run(run_id).status == RunStatus.ABORTED,
               what="the detached run to be aborted")
    run = eventually(lambda: (r := rt.store.get_run(run_id)) and r.reclaim_outcome and r,
                     what="the reclaim")
    assert run.status == RunStatus.ABORTED and run.cancel_requested
    assert rt.store.get_lease(lease_id).state == LeaseState.DESTROYED


def test_secrets_never_reach_results_store_logs_or_flower(stack: WorkerStack) -> None:
    port = free_port()
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}",
         "--address=127.0.0.1", "--basic-auth=ops:flower-pass"], env=stack.env,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 30, flower)

        def flower_tasks() -> dict[str, Any]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/tasks",
                headers={"Authorization": "Basic " + base64.b64encode(b"ops:flower-pass").decode()})
            with urllib.request.urlopen(request) as resp:
                return dict(json.load(resp))

        def flower_listens() -> bool:  # Flower sees events only once it has subscribed
            probe = app.send_task("run.attach", kwargs={"run_id": "flower-probe"})
            return bool(eventually(probe.ready, 10, "probe")) and (
                probe.id in flower_tasks())

        eventually(flower_listens, what="Flower to receive task events")
        spec = {"secret_env": {"API_TOKEN": SECRET}, "env": {"VISIBLE": "yes"}}
        async_result = producer.acquire_lease(rid(), spec)
        result = async_result.get(60)
        lease_id = result["lease_id"]
        assert SECRET not in json.dumps(result)

        def flower_task() -> dict[str, Any] | None:
            task = flower_tasks().get(async_result.id)
            return task if task and task.get("state") == "SUCCESS" else None

        shown = eventually(flower_task, what="Flower to show the acquire task")
        assert shown["name"] == "lease.acquire"
        assert "API_TOKEN" in shown["kwargs"] and "***" in shown["kwargs"]
        assert SECRET not in json.dumps(shown)
        # The sandbox itself does get the secret.
        workspace = stack.runtime().store.get_lease(lease_id).provider_meta["workspace"]
        pid = stack.runtime().store.get_lease(lease_id).provider_meta["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert f"API_TOKEN={SECRET}".encode() in environ and workspace
        producer.destroy_lease(lease_id).get(30)
    finally:
        flower.terminate()
        flower.wait(10)
    assert SECRET not in stack.logfile.read_text()
    dump = "\n".join(subprocess.run(
        [sys.executable, "-c", "import sys,sqlalchemy as sa;"
         "e=sa.create_engine(sys.argv[1]);c=e.connect();"
         "[print(r) for t in ('leases','runs','lease_events') for r in "
         "c.execute(sa.text('select * from '+t))]", stack.store_url],
        capture_output=True, text=True, check=True).stdout.splitlines())
    assert lease_id in dump and SECRET not in dump


def test_unknown_lease_is_a_clear_error(stack: WorkerStack) -> None:
    with pytest.raises(Exception, match="no lease 'missing-lease'"):
        producer.check_resumable("missing-lease").get(30)


def test_result_of_a_dead_broker_is_a_timeout_not_a_hang(stack: WorkerStack) -> None:
    # Sanity for callers: .get(timeout) bounds every wait.
    with pytest.raises(CeleryTimeout):
        app.AsyncResult(str(uuid.uuid4())).get(timeout=0.5)
