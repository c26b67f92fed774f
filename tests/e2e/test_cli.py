"""The operator CLI against a live stack (a real worker, the session Redis, a real store):
every read command's --json, the tables, the filters and pages, destroy through the normal
task path, status and health with their exit codes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.e2e.conftest import leasekeeper
from tests.stack import WorkerStack

pytestmark = pytest.mark.timeout(900)


def cli(stack: WorkerStack, *args: str, code: int = 0) -> str:
    done = leasekeeper(*args, env=stack.env)
    assert done.returncode == code, f"{args}: {done.returncode}\n{done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr
    return done.stdout


def cli_json(stack: WorkerStack, *args: str, code: int = 0) -> Any:
    return json.loads(cli(stack, *args, "--json", code=code))


def test_the_operator_cli_on_a_live_stack(stack: WorkerStack) -> None:
    from tasks import producer

    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    runs = [f"{tenant}-run-{i}" for i in range(2)]
    leases = [producer.acquire_lease(run, {"tenant": tenant, "thread_id": run}).get(120)
              ["lease_id"] for run in runs]

    # leases list: filters, a page at a time, newest first.
    page = cli_json(stack, "leases", "list", "--tenant", tenant, "--limit", "1")
    assert (page["total"], page["total_capped"], page["limit"], page["next_before"]) == (
        2, False, 1, leases[1])
    assert [x["lease_id"] for x in page["leases"]] == [leases[1]]
    rest = cli_json(stack, "leases", "list", "--tenant", tenant, "--limit", "1", "--before",
                    page["next_before"])
    assert [x["lease_id"] for x in rest["leases"]] == [leases[0]] and rest["next_before"] is None
    assert "next page: --before " + leases[1] in cli(stack, "leases", "list", "--tenant",
                                                      tenant, "--limit", "1")
    cli(stack, "leases", "list", "--before", "no good", code=2)
    assert cli_json(stack, "leases", "list", "--tenant", tenant, "--state", "destroyed")[
        "total"] == 0
    assert cli_json(stack, "leases", "list", "--tenant", tenant, "--older-than", "1d")[
        "total"] == 0
    text = cli(stack, "leases", "list", "--tenant", tenant)
    header, *rows, footer = text.splitlines()
    assert header.split()[:4] == ["LEASE", "STATE", "PROVIDER", "TENANT"]
    assert all(row.index("active") == header.index("STATE") for row in rows)
    assert footer == "2 of 2 lease(s)"

    # leases show: the fields, the run and its status, then the history with task ids.
    shown = cli_json(stack, "leases", "show", leases[0])
    assert shown["lease"]["tenant"] == tenant and shown["lease"]["state"] == "active"
    assert shown["lease"]["deadline_at"] and shown["lease"]["provider_lease_id"]
    assert (shown["run"]["run_id"], shown["run"]["status"]) == (runs[0], "running")
    assert [e["to_state"] for e in shown["events"]] == ["provisioning", "active"]
    assert all(e["task_id"] for e in shown["events"])
    text = cli(stack, "leases", "show", leases[0][:20])  # a unique prefix will do
    assert text.startswith(f"lease:            {leases[0]}\n")
    assert text.index("tenant:") < text.index("history:")
    assert f"run:              {runs[0]} (running)" in text

    # runs list / show.
    listed = cli_json(stack, "runs", "list", "--thread", runs[0])
    assert [(r["run_id"], r["lease_id"]) for r in listed["runs"]] == [(runs[0], leases[0])]
    assert cli_json(stack, "runs", "show", runs[1])["lease"]["lease_id"] == leases[1]
    cli(stack, "runs", "list", "--status", "done", code=2)

    # destroy one lease through lease.destroy; its history records the task.
    answer = cli_json(stack, "leases", "destroy", leases[0])
    assert [(d["lease_id"], d["result"]) for d in answer["destroyed"]] == [
        (leases[0], "destroyed")]
    events = cli_json(stack, "leases", "show", leases[0])["events"]
    assert events[-1]["to_state"] == "destroyed"
    assert events[-1]["task_id"] == answer["destroyed"][0]["task_id"]

    # bulk destroy: a dry listing without --yes (exit 0: it did what was asked), then
    # through the workers with it.
    preview = cli_json(stack, "leases", "destroy", "--state", "active", "--tenant", tenant,
                       "--older-than", "0s")
    assert [x["lease_id"] for x in preview["would_destroy"]] == [leases[1]]
    assert stack.runtime().store.get_lease(leases[1]).state == "active"
    bulk = cli_json(stack, "leases", "destroy", "--state", "active", "--tenant", tenant,
                    "--older-than", "0s", "--yes")
    assert [(d["lease_id"], d["result"]) for d in bulk["destroyed"]] == [
        (leases[1], "destroyed")]
    assert cli_json(stack, "leases", "list", "--tenant", tenant, "--state", "destroyed")[
        "total"] == 2

    # status: this stack runs no beat, so it needs a person (exit 1) and says why.
    status = cli_json(stack, "status", code=1)
    assert stack.hostname(1) in status["workers"]
    assert status["store"]["leases"]["destroyed"]["local"] >= 2
    assert status["verdict"]["ok"] is False
    assert any("beat is not running" in p for p in status["verdict"]["problems"])
    assert {t["sweep"] for t in status["sweeps"]} >= {"sweep.reap_runs", "sweep.orphans"}
    assert "verdict: NEEDS A PERSON" in cli(stack, "status", code=1)

    # health: quiet on success, one line per failure.
    done = leasekeeper("health", "--worker", "--node", stack.hostname(1), "--store",
                       "--broker", env=stack.env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    done = leasekeeper("health", "--beat", env=stack.env)
    assert done.returncode == 1 and done.stderr.startswith("unhealthy beat: ")
    done = leasekeeper("health", "--worker", "--node", "nobody@nowhere", env=stack.env)
    assert done.returncode == 1 and "nobody@nowhere" in done.stderr

    # exit codes: an unknown id is 4, one line.
    done = leasekeeper("leases", "show", "0000000000000000000000000000dead", env=stack.env)
    assert done.returncode == 4 and len(done.stderr.strip().splitlines()) == 1


def test_reap_dry_run_prints_json(stack: WorkerStack) -> None:
    from tasks.reap import SWEEPS

    before = {lease.lease_id: lease.state for lease in stack.runtime().store.leases()}
    shown = cli_json(stack, "reap", "--dry-run")
    assert shown["dry_run"] is True
    assert [s["sweep"] for s in shown["sweeps"]] == list(SWEEPS)
    assert all(s["run"] in ("dry_run", "skipped") and "took_ms" in s for s in shown["sweeps"])
    # and it changed nothing
    assert {lease.lease_id: lease.state for lease in stack.runtime().store.leases()} == before
    one = cli_json(stack, "reap", "--dry-run", "--sweep", "sweep.expire_leases")
    assert [s["sweep"] for s in one["sweeps"]] == ["sweep.expire_leases"]


def test_health_and_status_count_only_this_installations_workers(stack: WorkerStack) -> None:
    """Another installation on the same Redis (its own LEASEKEEPER_TASK_QUEUE) has no
    worker: the stack's worker, which serves the other queues, must not make it healthy."""
    lonely = {**stack.env, "LEASEKEEPER_TASK_QUEUE": f"lonely-{uuid.uuid4().hex[:8]}"}
    done = leasekeeper("health", "--worker", env=lonely)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("unhealthy worker: no worker of this installation")
    assert "LEASEKEEPER_TASK_QUEUE" in done.stderr
    # a node that is up but serves another installation is not this one's worker either
    done = leasekeeper("health", "--worker", "--node", stack.hostname(1), env=lonely)
    assert done.returncode == 1 and stack.hostname(1) in done.stderr, done.stderr
    status = json.loads(leasekeeper("status", "--json", env=lonely).stdout)
    assert status["workers"] == []
    assert any("no worker of this installation" in p for p in status["verdict"]["problems"])
    # the stack's own installation still sees its worker
    done = leasekeeper("health", "--worker", env=stack.env)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_filtered_destroy_past_its_limit_says_more_match(stack: WorkerStack) -> None:
    # Before: it destroyed --limit leases, said nothing of the others, and exited 0.
    from tasks import producer

    tenant = f"lim-{uuid.uuid4().hex[:8]}"
    leases = [producer.acquire_lease(f"{tenant}-run-{i}", {"tenant": tenant, "provider": "noop"}
                                     ).get(120)["lease_id"] for i in range(3)]
    preview = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant,
                          "--limit", "2", env=stack.env)
    assert preview.returncode == 0, preview.stderr
    assert "would destroy 2 lease(s) (the newest 2 of 3 that match: --limit 2)" \
        in preview.stderr
    first = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant,
                        "--limit", "2", "--yes", "--json", env=stack.env)
    assert first.returncode == 1, first.stdout + first.stderr
    answer = json.loads(first.stdout)
    assert [(d["lease_id"], d["result"]) for d in answer["destroyed"]] == [
        (leases[2], "destroyed"), (leases[1], "destroyed")]
    assert answer["more_matching"] == 1
    assert "3 lease(s) match and --limit 2 took the newest 2: 1 more was not destroyed; " \
        "run the same command again for the next ones" in first.stderr
    # Going on as it says ends the rest, and then it has nothing more to say.
    rest = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant,
                       "--limit", "2", "--yes", "--json", env=stack.env)
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert [d["lease_id"] for d in json.loads(rest.stdout)["destroyed"]] == [leases[0]]
    assert json.loads(rest.stdout)["more_matching"] == 0 and "more" not in rest.stderr
