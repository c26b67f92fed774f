"""The task contract as a web backend with only ``celery[redis]`` sees it: every task sent
by name (README "Enqueueing from a web backend") to a real worker with events on, watched
by a real Flower.

- every lifecycle task, with secrets, on its success and failure paths (a retry, a failed
  acquire, a failed destroy, an unknown task name, positional arguments, a bad spec, a
  command that does not exist, a task waiting for its countdown as ``celery inspect`` and
  Flower's worker page see it), and then, once every task has run and been acknowledged,
  not one secret value in Flower's API and task pages, the worker and Flower logs, every
  Redis key (task message bodies decoded), every store table, the result and error of
  every task, or the operator's console;
- until then a task's message does hold its ``secret_env`` in Redis (base64, not
  encrypted: Celery needs it to deliver the task, README "Secrets"): a message waiting in
  its queue shows it, decoded;
- every malformed payload gets a short ``InvalidRequest`` naming what is wrong, and
  creates nothing (no run or lease row, no sandbox);
- every run and lease task repeated is a no-op.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, inspect, text

from models.schema import LeaseState
from tests.contract.conftest import Contract
from tests.e2e.conftest import eventually
from tests.services import RedisServer
from tests.stack import REPO

pytestmark = pytest.mark.timeout(600)

# Quotes, braces and backslashes: the hardest values to find again in reprs of JSON.
# Each value's random middle is what the leak checks look for, however it was escaped.
CORES = {name: uuid.uuid4().hex for name in (
    "API_TOKEN", "DB_PASSWORD", "RETRY_KEY", "FAILED_KEY", "DESTROY_KEY", "UNKNOWN_KEY",
    "POSITIONAL_KEY", "BADSPEC_KEY", "NOCMD_KEY", "EXTRA_KEY", "SCHEDULED_KEY", "RAW_KEY",
    "CAMEL_KEY", "DASH_KEY", "TOP_KEY", "OTHER_KEY")}
SECRETS = {name: f"{name.lower()}-{CORES[name]}" + tail for name, tail in [
    ("API_TOKEN", ""), ("DB_PASSWORD", "'q\"}{\\"), ("RETRY_KEY", ""), ("FAILED_KEY", ""),
    ("DESTROY_KEY", ""), ("UNKNOWN_KEY", ""), ("POSITIONAL_KEY", ""), ("BADSPEC_KEY", ""),
    ("NOCMD_KEY", ""), ("EXTRA_KEY", ""), ("SCHEDULED_KEY", ""), ("RAW_KEY", ""),
    ("CAMEL_KEY", ""), ("DASH_KEY", "'q\"}{\\"), ("TOP_KEY", ""), ("OTHER_KEY", ""),
]}
MAX_ERROR_CHARS = 400


def rid(tag: str) -> str:
    return f"contract-{tag}-{uuid.uuid4().hex[:8]}"


def secret_spec(*names: str, **spec: Any) -> dict[str, Any]:
    return {"secret_env": {n: SECRETS[n] for n in names}, "env": {"VISIBLE": "yes"}, **spec}


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["state"] == "SUCCESS", reply
    result: dict[str, Any] = reply["result"]
    return result


def refused(reply: dict[str, Any], *mentions: str) -> str:
    """The task failed with a short InvalidRequest (or terminal error) naming ``mentions``."""
    assert reply["state"] == "FAILURE", reply
    error = reply["error"]
    message = str(error["message"])
    assert error["type"] in {"InvalidRequest", "TerminalProviderError"}, error
    assert len(message) <= MAX_ERROR_CHARS, f"{len(message)} characters: {message[:200]}"
    for mention in mentions:
        assert mention in message, message
    return message


def lease_state(contract: Contract, lease_id: str) -> str:
    return str(contract.stack.runtime().store.get_lease(lease_id).state)


def sandboxes(contract: Contract) -> set[str]:
    root = contract.stack.root / "sandboxes"
    found = {p.name for p in root.iterdir() if p.is_dir()} if root.exists() else set()
    faulty = root / "faulty"
    return found | ({f"faulty/{p.name}" for p in faulty.iterdir()} if faulty.exists() else set())


@pytest.fixture(scope="module")
def sent(contract: Contract) -> dict[str, Any]:
    """Drive every task with secrets through the worker, as a web backend would."""
    client, stack = contract.client, contract.stack
    out: dict[str, Any] = {"replies": []}

    def send(name: str, kwargs: dict[str, Any] | None = None, **opts: Any) -> dict[str, Any]:
        reply = client.send(name, kwargs, **opts)
        out["replies"].append(reply)
        return reply

    # The whole lifecycle, each task twice (a repeat or redelivery is a no-op).
    run_id = rid("life")
    acquired = ok(send("lease.acquire", {"run_id": run_id,
                                         "spec": secret_spec("API_TOKEN", "DB_PASSWORD")}))
    lease_id = acquired["lease_id"]
    assert acquired["result"] == "acquired"
    out["already"] = ok(send("lease.acquire", {"run_id": run_id, "spec": secret_spec(
        "API_TOKEN", "DB_PASSWORD")}))
    # The same run with another spec (a secret more, another command): refused, naming
    # the fields, never their values; the run and its sandbox go on as before.
    out["other_spec"] = send("lease.acquire", {"run_id": run_id, "spec": secret_spec(
        "API_TOKEN", "DB_PASSWORD", "OTHER_KEY", command=["sleep", "600"])})
    out["other_spec_ids"] = (run_id, lease_id)
    out["resume"] = ok(send("lease.resume_check", {"lease_id": lease_id}))
    out["touch"] = [ok(send("lease.touch", {"lease_id": lease_id})) for _ in range(2)]
    out["detach"] = [ok(send("run.detach", {"run_id": run_id}))]
    out["detached_since"] = [stack.runtime().store.get_run(run_id).detached_since]
    out["detach"].append(ok(send("run.detach", {"run_id": run_id})))
    out["detached_since"].append(stack.runtime().store.get_run(run_id).detached_since)
    out["attach"] = [ok(send("run.attach", {"run_id": run_id})) for _ in range(2)]
    out["finish"] = [ok(send("run.finish", {"run_id": run_id, "status": "completed",
                                            "exit_code": 0})) for _ in range(2)]
    eventually(lambda: lease_state(contract, lease_id) == LeaseState.DESTROYED, 60,
               "the finished run's sandbox reclaimed")
    out["reclaim_again"] = ok(send("sandbox.reclaim", {"run_id": run_id}))
    out["destroy"] = [ok(send("lease.destroy", {"lease_id": lease_id, "reason": "done"}))
                      for _ in range(2)]
    out["lifecycle"] = (run_id, lease_id)

    # A transient provider failure: the task is retried (task-retried event), then acquires.
    stack.faults.write({"acquire": [{"fault": "transient", "when": "before", "times": 1}]})
    retried_run = rid("retry")
    retried = ok(send("lease.acquire", {"run_id": retried_run, "spec": secret_spec(
        "RETRY_KEY", provider="faulty")}))
    # A destroy that fails: the lease waits for sweep.retry_cleanup, the task fails loudly.
    stack.faults.write({"destroy": [{"fault": "terminal", "when": "before", "times": 1}]})
    out["destroy_failed"] = send("lease.destroy", {"lease_id": retried["lease_id"]})
    stack.faults.write({})
    ok(send("lease.destroy", {"lease_id": retried["lease_id"]}))
    # An acquire that fails terminally after the intent was recorded: cleanup, then failure.
    stack.faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 1}]})
    out["acquire_failed"] = send("lease.acquire", {"run_id": rid("failed"), "spec": secret_spec(
        "FAILED_KEY", "DESTROY_KEY", provider="faulty")})
    stack.faults.write({})

    # Refused before anything exists, secrets in the payload.
    out["unknown"] = send("lease.acquier", {"run_id": rid("unknown"),
                                            "spec": secret_spec("UNKNOWN_KEY", "DB_PASSWORD")})
    out["positional"] = send("lease.acquire", args=[rid("pos"), secret_spec("POSITIONAL_KEY")])
    out["bad_spec"] = send("lease.acquire", {"run_id": rid("badspec"), "spec": secret_spec(
        "BADSPEC_KEY", reuse="yes")})
    out["no_command"] = send("lease.acquire", {"run_id": rid("nocmd"), "spec": secret_spec(
        "NOCMD_KEY", command=["no-such-command-here", "--flag"])})
    out["extra"] = send("lease.acquire", {"run_id": rid("extra"), "spec": {},
                                          "secret_env": {"EXTRA_KEY": SECRETS["EXTRA_KEY"]}})
    # The secret field misspelt: refused, and its values hidden wherever it is reported.
    out["camel"] = send("lease.acquire", {"run_id": rid("camel"), "spec": {
        "secretEnv": {"CAMEL_KEY": SECRETS["CAMEL_KEY"]}, "env": {"VISIBLE": "yes"}}})
    out["dash"] = send("lease.acquire", {"run_id": rid("dash"), "spec": {
        "secret-env": {"DASH_KEY": SECRETS["DASH_KEY"]}}})
    out["top"] = send("lease.acquire", {"run_id": rid("top"), "spec": {},
                                        "Secret-Env": {"TOP_KEY": SECRETS["TOP_KEY"]}})

    # A message that is not even JSON (cut short), for a real task name: Celery logs it.
    task_id = str(uuid.uuid4())
    client.request(op="raw", headers={"id": task_id, "task": "lease.acquire", "lang": "py"},
                   body='[[], {"spec": {"secret_env": {"RAW_KEY": "' + SECRETS["RAW_KEY"])

    # A task waiting for its countdown, as `celery inspect scheduled` (and Flower) see it.
    scheduled = client.send("lease.acquire", {"run_id": rid("sched"), "spec": secret_spec(
        "SCHEDULED_KEY")}, countdown=3, wait_s=0)

    def inspected() -> str | None:
        reply = json.dumps(client.request(op="inspect", method="scheduled"))
        return reply if scheduled["id"] in reply else None

    out["inspect_scheduled"] = eventually(inspected, 30, "the scheduled task in inspect")
    done = ok(client.get(scheduled["id"]))
    out["replies"].append(client.get(scheduled["id"]))
    ok(send("lease.destroy", {"lease_id": done["lease_id"]}))
    return out


def test_the_client_has_only_celery(contract: Contract) -> None:
    python = contract.client.proc.args[0]
    probe = subprocess.run([python, "-I", "-c", "import celery, tasks"], capture_output=True,
                           text=True, cwd="/", check=False)
    assert probe.returncode != 0 and "No module named 'tasks'" in probe.stderr


def test_every_lifecycle_task_by_name_and_repeated_is_a_no_op(sent: dict[str, Any]) -> None:
    assert sent["already"]["result"] == "already_acquired"
    assert sent["resume"]["resumable"] is True
    assert all(t["touched"] for t in sent["touch"])  # touch is activity, every time
    assert [d["change"] for d in sent["detach"]] == ["changed", "unchanged"]
    first, second = sent["detached_since"]
    assert first is not None and first == second  # a repeated detach never postpones the reap
    assert [a["change"] for a in sent["attach"]] == ["changed", "unchanged"]
    assert [f["change"] for f in sent["finish"]] == ["changed", "unchanged"]
    assert [f["reclaim_enqueued"] for f in sent["finish"]] == [True, False]
    assert [d["result"] for d in sent["destroy"]] == ["already_ended", "already_ended"]


def test_failure_paths_fail_loudly_and_briefly(sent: dict[str, Any]) -> None:
    assert sent["destroy_failed"]["state"] == "FAILURE"
    assert "injected terminal fault in destroy" in sent["destroy_failed"]["error"]["message"]
    assert sent["acquire_failed"]["state"] == "FAILURE"
    assert "injected terminal fault in acquire" in sent["acquire_failed"]["error"]["message"]
    assert sent["unknown"]["state"] == "FAILURE"
    assert sent["unknown"]["error"]["type"] == "NotRegistered"
    refused(sent["positional"], "keyword arguments only", "kwargs")
    refused(sent["bad_spec"], "reuse", "valid boolean")
    refused(sent["no_command"], "'no-such-command-here'", "not found")
    refused(sent["extra"], "unknown field(s) 'secret_env'")
    refused(sent["camel"], "secretEnv", "Extra inputs are not permitted")
    refused(sent["dash"], "secret-env", "Extra inputs are not permitted")
    refused(sent["top"], "unknown field(s) 'Secret-Env'")
    run_id, lease_id = sent["other_spec_ids"]
    refused(sent["other_spec"], f"run {run_id} already has lease {lease_id} (active)",
            "(differing fields: command, secret_env)", "start a new run", "same spec")


def test_not_one_secret_anywhere(contract: Contract, sent: dict[str, Any]) -> None:
    stack, flower = contract.stack, contract.flower
    ids = [r["id"] for r in sent["replies"]]

    def flower_has_every_task() -> bool:
        shown = flower.tasks()
        return all(i in shown and shown[i].get("state") in {"SUCCESS", "FAILURE"} for i in ids)

    eventually(flower_has_every_task, 60, "Flower to show every task's outcome")
    places: dict[str, str] = {
        "flower /api/tasks": flower.fetch("/api/tasks"),
        "flower /tasks": flower.fetch("/tasks"),
        "flower /api/workers": flower.fetch("/api/workers?refresh=1"),
        "flower task pages": "\n".join(flower.fetch(f"/task/{i}") for i in ids),
        "flower task info": "\n".join(flower.fetch(f"/api/task/info/{i}") for i in ids),
        "client replies (results and errors)": json.dumps(sent["replies"]),
        "celery inspect scheduled": sent["inspect_scheduled"],
        # every task done and acknowledged: no message holds a secret any more
        "redis (broker and result backend)": redis_dump(contract.redis.url),
        "store (every table)": store_dump(stack.store_url),
        "console (leases list/show)": console(contract),
    }
    # Flower shows the tasks, their redacted arguments and their errors.
    assert "API_TOKEN" in places["flower task pages"] and "***" in places["flower /api/tasks"]
    assert "NotRegistered" in places["flower /api/tasks"]
    places["worker log"] = stack.logfile.read_text(errors="replace")
    places["flower log"] = flower.logfile.read_text(errors="replace")
    assert "Received unregistered task of type 'lease.acquier'" in places["worker log"]
    assert "retry" in places["worker log"]  # the retried acquire was logged
    assert "Can't decode message body" in places["worker log"]  # the raw message, reported
    leaks = {where: sorted(n for n, core in CORES.items() if core in text)
             for where, text in places.items()}
    leaks = {where: names for where, names in leaks.items() if names}
    assert not leaks, f"secret values shown: {leaks}"
    # ...while the sandbox itself did get them (they are only withheld from everyone else).
    assert "VISIBLE" in places["store (every table)"]


def test_a_message_waiting_in_redis_holds_its_secret_env_base64_encoded(
        redis_server: RedisServer) -> None:
    # What README "Secrets" says of the broker: an acquire sent to a queue no worker
    # reads waits there with its secret_env in its body, which any reader of Redis can
    # decode; the checks above hold only once every message is acknowledged.
    from workers.app import app

    queue = f"nobody-reads-{uuid.uuid4().hex[:8]}"
    secret = f"waiting-{uuid.uuid4().hex}"
    app.send_task("lease.acquire", queue=queue, kwargs={
        "run_id": rid("waiting"), "spec": {"provider": "noop", "secret_env": {"K": secret}}})
    try:
        waiting = [line for line in redis_dump(redis_server.url).splitlines()
                   if line.startswith(repr(queue.encode()))]
        assert waiting and not any(secret in line for line in waiting if " body " not in line)
        assert any(secret in line for line in waiting if " message body " in line), waiting
    finally:
        redis.Redis.from_url(redis_server.url).delete(queue)


def redis_dump(url: str) -> str:
    """Every key and value, and the decoded body of every task message among them (kombu
    stores a body base64-encoded: a secret in one would not show in the raw value)."""
    client = redis.Redis.from_url(url)
    lines = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            value: Any = client.get(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "set":
            value = client.smembers(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            value = kind
        lines.append(f"{key!r} {value!r}")
        raws = (value.values() if isinstance(value, dict)
                else value if isinstance(value, list) else [value])
        lines += [f"{key!r} message body {body!r}" for raw in raws
                  for body in message_bodies(raw)]
    assert lines, "the result backend holds the results"
    return "\n".join(lines)


def message_bodies(raw: object) -> list[bytes]:
    """The decoded bodies of the kombu messages in ``raw`` (a queue's entry, or an
    ``unacked`` entry: ``[message, exchange, routing_key]``); none if it holds none."""
    if not isinstance(raw, bytes):
        return []
    try:
        found = json.loads(raw)
    except ValueError:
        return []
    bodies: list[bytes] = []
    for part in found if isinstance(found, list) else [found]:
        if (isinstance(part, dict) and isinstance(part.get("body"), str)
                and (part.get("properties") or {}).get("body_encoding") == "base64"):
            bodies.append(base64.b64decode(part["body"]))
    return bodies


def store_dump(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = [f"{table}: {tuple(row)!r}" for table in inspect(engine).get_table_names()
                    for row in conn.execute(text(f'SELECT * FROM "{table}"'))]
    finally:
        engine.dispose()
    return "\n".join(rows)


def console(contract: Contract) -> str:
    env = contract.stack.env
    cli = [sys.executable, "-m", "workers.cli", "leases"]
    # Both renderings of the listing: the table and --json (which gives the ids to show).
    listed = subprocess.run([*cli, "list", "--limit", "1000"], env=env, cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    as_json = subprocess.run([*cli, "list", "--limit", "1000", "--json"], env=env, cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    ids = [lease["lease_id"] for lease in json.loads(as_json)["leases"]]
    shown = [subprocess.run([*cli, "show", lease_id, *form], env=env, cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
             for lease_id in ids for form in ((), ("--json",))]
    assert shown, listed
    return listed + as_json + "\n".join(shown)


# -- malformed payloads: a short, clear error each, and nothing created -------------------
BIG = 10 * 1024 * 1024
MALFORMED: list[tuple[str, str, dict[str, Any] | None, list[Any] | None, tuple[str, ...]]] = [
    ("destroy 10 MB id", "lease.destroy", {"lease_id": "x" * BIG}, None,
     ("LEASEKEEPER_MAX_PAYLOAD_BYTES",)),
    ("detach 10 MB id", "run.detach", {"run_id": "x" * BIG}, None,
     ("LEASEKEEPER_MAX_PAYLOAD_BYTES",)),
    ("destroy long id", "lease.destroy", {"lease_id": "x" * 5000}, None,
     ("lease_id must be 1-128 characters", "got a string of 5000 characters")),
    ("resume id with a slash", "lease.resume_check", {"lease_id": "../etc"}, None,
     ("lease_id must be",)),
    ("touch id not a string", "lease.touch", {"lease_id": 12}, None, ("lease_id", "int")),
    ("reclaim run_id object", "sandbox.reclaim", {"run_id": {"a": 1}}, None,
     ("run_id must be", "got a dict")),
    ("attach no run_id", "run.attach", {}, None, ("missing field(s) run_id",)),
    ("acquire no run_id", "lease.acquire", {"spec": {}}, None, ("missing field(s) run_id",)),
    ("acquire extra kwarg", "lease.acquire", {"run_id": "r-1", "spce": {}}, None,
     ("unknown field(s) 'spce'", "run_id, spec")),
    ("acquire positional", "lease.acquire", None, ["r-1", {}], ("kwargs",)),
    ("acquire spec not an object", "lease.acquire", {"run_id": "r-1", "spec": "yes"}, None,
     ("valid dictionary",)),
    ("acquire reuse 'yes'", "lease.acquire", {"run_id": "r-1", "spec": {"reuse": "yes"}}, None,
     ("reuse", "valid boolean")),
    # reuse keyed by the tenant alone would hand one run's sandbox to every other
    ("acquire reuse without thread or key", "lease.acquire",
     {"run_id": "r-1", "spec": {"reuse": True, "tenant": "acme",
                                "secret_env": {"TOK": SECRETS["RAW_KEY"]}}}, None,
     ("reuse needs thread_id or sandbox_key",)),
    ("acquire ttl_s '60'", "lease.acquire", {"run_id": "r-1", "spec": {"ttl_s": "60"}}, None,
     ("ttl_s", "valid integer")),
    ("acquire 100 KB env value", "lease.acquire",
     {"run_id": "r-1", "spec": {"env": {"BIG": "v" * 100_000}}}, None, ("env.BIG", "at most")),
    ("acquire 100 KB argument", "lease.acquire",
     {"run_id": "r-1", "spec": {"command": ["echo", "a" * 100_000]}}, None,
     ("command.1", "at most")),
    ("acquire 1000 arguments", "lease.acquire",
     {"run_id": "r-1", "spec": {"command": ["echo"] * 1000}}, None, ("command", "at most")),
    ("acquire 200 labels", "lease.acquire",
     {"run_id": "r-1", "spec": {"labels": {f"k{i}": "v" for i in range(200)}}}, None,
     ("labels", "at most")),
    ("acquire huge label", "lease.acquire",
     {"run_id": "r-1", "spec": {"labels": {"k": "v" * 5000}}}, None, ("label 'k'",)),
    ("acquire spec too big in total", "lease.acquire",
     {"run_id": "r-1", "spec": {"env": {f"E{i}": "v" * 30_000 for i in range(8)}}}, None,
     ("add up to",)),
    ("acquire missing command", "lease.acquire",
     {"run_id": "r-1", "spec": {"command": ["/no/such/binary"]}}, None,
     ("'/no/such/binary'", "not found")),
    # an error over the limit: the run is not finished, and the sender learns how to cut
    ("finish 1 MB error", "run.finish",
     {"run_id": "r-1", "status": "failed", "error": "\u00e9" * 300_000}, None,
     ("LEASEKEEPER_MAX_PAYLOAD_BYTES", "the run is not finished",
      "the rest cut before sending]")),
    ("acquire tenant not DNS-safe", "lease.acquire",
     {"run_id": "r-1", "spec": {"tenant": "Acme!"}}, None,
     ("tenant: tenant must be 1-40 lowercase letters",)),
    ("acquire empty program name", "lease.acquire",
     {"run_id": "r-1", "spec": {"command": [""]}}, None,
     ("command.0", "empty: the first argument names the program to run")),
    ("finish bad status", "run.finish", {"run_id": "r-1", "status": "x" * 5000}, None,
     ("status must be one of",)),
    ("finish exit_code string", "run.finish",
     {"run_id": "r-1", "status": "completed", "exit_code": "0"}, None, ("exit_code",)),
    ("destroy reason object", "lease.destroy", {"lease_id": "l-1", "reason": {}}, None,
     ("reason must be a string",)),
    # values execve() cannot take, and durations no clock can: refused before the intent
    ("acquire NUL in an env value", "lease.acquire",
     {"run_id": "r-1", "spec": {"env": {"A": "x\0y"}}}, None, ("env.A", "NUL")),
    ("acquire NUL in a secret", "lease.acquire",
     {"run_id": "r-1", "spec": {"secret_env": {"TOK": SECRETS["RAW_KEY"] + "\0"}}}, None,
     ("secret_env.TOK", "NUL")),
    ("acquire NUL in an argument", "lease.acquire",
     {"run_id": "r-1", "spec": {"command": ["sleep", "1\0"]}}, None, ("command.1", "NUL")),
    ("acquire ttl_s 10**12", "lease.acquire", {"run_id": "r-1", "spec": {"ttl_s": 10**12}},
     None, ("ttl_s", "less than or equal to")),
    ("acquire idle_timeout_s 10**20", "lease.acquire",
     {"run_id": "r-1", "spec": {"idle_timeout_s": 10**20}}, None, ("idle_timeout_s",)),
    # an error about secret_env itself stays readable through the worker's scrubbing
    ("acquire secret_env bad name", "lease.acquire",
     {"run_id": "r-1", "spec": {"secret_env": {"bad-name": SECRETS["RAW_KEY"]}}}, None,
     ("secret_env is invalid", "'bad-name'")),
    ("acquire secret_env a string", "lease.acquire",
     {"run_id": "r-1", "spec": {"secret_env": SECRETS["RAW_KEY"]}}, None,
     ("secret_env is invalid", "valid dictionary")),
    ("acquire our own label", "lease.acquire",
     {"run_id": "r-1", "spec": {"labels": {"leasekeeper.dev/lease-id": "x"}}}, None,
     ("leasekeeper.dev/ prefix",)),
    ("acquire unknown backend", "lease.acquire",
     {"run_id": "r-1", "spec": {"provider": "local", "backend": "bogus"}}, None,
     ("unknown backend 'bogus'",)),
    ("finish exit_code 2**63", "run.finish",
     {"run_id": "r-1", "status": "failed", "exit_code": 2**63}, None,
     ("exit_code must be an integer from",)),
    ("finish error object", "run.finish",
     {"run_id": "r-1", "status": "failed", "error": {"x": 1}}, None,
     ("error must be a string",)),
]


@pytest.mark.parametrize(("name", "kwargs", "args", "mentions"),
                         [pytest.param(*case[1:], id=case[0]) for case in MALFORMED])
def test_a_malformed_payload_is_refused_briefly_and_creates_nothing(
    contract: Contract, name: str, kwargs: dict[str, Any] | None, args: list[Any] | None,
    mentions: tuple[str, ...],
) -> None:
    before_store, before_sandboxes = store_dump(contract.stack.store_url), sandboxes(contract)
    size_before = contract.stack.logfile.stat().st_size
    message = refused(contract.client.send(name, kwargs, args=args), *mentions)
    # in the sender's words, not pydantic's ("tenant: Value error, tenant must be ...")
    assert "Value error" not in message, message
    assert store_dump(contract.stack.store_url) == before_store
    assert sandboxes(contract) == before_sandboxes
    # The worker's log grows by a few lines, not by the payload, and no secret sent shows.
    with contract.stack.logfile.open("rb") as log:
        log.seek(size_before)
        grown = log.read()
    assert len(grown) < 20_000
    for core in CORES.values():
        assert core not in message and core.encode() not in grown


def test_the_worker_says_which_broker_it_uses(contract: Contract) -> None:
    log = contract.stack.logfile.read_text(errors="replace")
    assert f"broker {contract.redis.url} (from LEASEKEEPER_BROKER_URL)" in log
    assert os.environ.get("LEASEKEEPER_BROKER_URL")  # the session's, passed to the worker
    assert Path(contract.stack.root).exists()
