"""`leasekeeper status` and `health` against workers split by lane (-Q): a lane with tasks
waiting and no worker consuming it needs a person, though other lanes' workers answer.

Found by an operator: with only a `-Q <base>.cleanup,<base>.sweeps` worker left, 20 acquires
waited in `<base>.acquire` while status said `verdict: ok` and health exited 0 (the exporter's
leasekeeper_lane_workers said 0 for the lane)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from models.migrate import upgrade
from tasks import producer
from tests.e2e.conftest import eventually, leasekeeper
from tests.services import RedisServer
from tests.stack import REPO, WorkerStack, sending_to
from workers.heartbeats import last_beat
from workers.queues import Lane, queue_name

pytestmark = pytest.mark.timeout(600)
WAITING = 20
NOOP = {"provider": "noop"}


@pytest.fixture
def split(redis_server: RedisServer, tmp_path: Path) -> Iterator[WorkerStack]:
    """An installation of its own on the session Redis (a fresh SQLite store), no worker
    yet; this test process sends to it."""
    queue = f"split-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=queue, store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    with sending_to(queue):
        try:
            yield stack
        finally:
            stack.stop()


@contextlib.contextmanager
def beat(stack: WorkerStack, redis_server: RedisServer) -> Iterator[None]:
    """A real celery beat on the stack's installation, from its first tick to the block's
    end (not in stack.procs, whose order names the workers)."""
    with open(stack.root / "beat.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.app", "beat", "-l", "info"],
            cwd=REPO, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    client = redis.Redis.from_url(redis_server.url)
    try:
        eventually(lambda: last_beat(client, stack.name), 60, "beat's first tick")
        yield
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def status(stack: WorkerStack, code: int) -> tuple[dict[str, Any], str]:
    as_json = leasekeeper("status", "--json", env=stack.env)
    text = leasekeeper("status", env=stack.env)
    for done in (as_json, text):
        assert done.returncode == code, f"{done.returncode}\n{done.stdout}{done.stderr}"
        assert "Traceback" not in done.stderr
    return json.loads(as_json.stdout), text.stdout


def health(stack: WorkerStack, *flags: str) -> subprocess.CompletedProcess[str]:
    return leasekeeper("health", *flags, env=stack.env)


def lane(report: dict[str, Any], name: Lane) -> dict[str, Any]:
    (row,) = [row for row in report["lanes"] if row["lane"] == name.value]
    return row


def send_acquires() -> None:
    for _ in range(WAITING):
        producer.acquire_lease(f"wait-{uuid.uuid4().hex[:10]}", NOOP)


def test_a_lane_with_waiting_tasks_and_no_worker_needs_a_person(
        split: WorkerStack, redis_server: RedisServer) -> None:
    # given beat, and one worker that consumes only the cleanup and sweeps lanes (the
    # all-lanes worker is gone), and acquires sent to the acquire lane
    base = split.name
    acquire = queue_name(base, Lane.ACQUIRE)
    cleaner = split.hostname(1)
    split.start_worker(concurrency=1, queues=[queue_name(base, Lane.CLEANUP),
                                              queue_name(base, Lane.SWEEPS)])
    with beat(split, redis_server):
        send_acquires()
        lanes_served_or_not(split, redis_server, cleaner, acquire)


def lanes_served_or_not(split: WorkerStack, redis_server: RedisServer, cleaner: str,
                        acquire: str) -> None:
    """With beat up, only ``cleaner`` (-Q cleanup,sweeps) on, and acquires waiting."""
    # then status needs a person: the acquire lane has tasks waiting and no worker
    report, text = status(split, code=1)
    assert report["workers"] == [cleaner]
    assert lane(report, Lane.ACQUIRE) == {"lane": "acquire", "queue": acquire,
                                          "waiting": WAITING, "workers": [],
                                          "service": "unserved_waiting"}
    assert lane(report, Lane.CLEANUP)["workers"] == [cleaner]
    assert lane(report, Lane.CLEANUP)["service"] == "served"
    problems = report["verdict"]["problems"]
    assert problems == [
        f"lane acquire: {WAITING} task(s) wait in {acquire} and no worker consumes it: "
        f"start a worker with -Q {acquire} (or add it to a worker's -Q), or one without -Q"]
    # and the lanes no one serves with nothing waiting are notes, not problems
    notes = report["verdict"]["notes"]
    assert [n.split(":")[0] for n in notes] == ["lane default", "lane pool"], notes
    assert "verdict: NEEDS A PERSON" in text and f"  - {problems[0]}" in text
    assert f"acquire  {acquire}  {WAITING}       NONE" in text, text
    assert f"{WAITING} waiting in all" in text and "  note: lane pool" in text, text

    # and health fails the same way, without flags and with --worker, one line per lane
    for flags in ((), ("--worker",)):
        done = health(split, *flags)
        assert (done.returncode, done.stdout) == (1, ""), (flags, done.stderr)
        assert done.stderr == f"unhealthy worker: {problems[0]}\n", (flags, done.stderr)
    # but a probe of one worker (--node) asks only whether that worker answers
    done = health(split, "--worker", "--node", cleaner)
    assert (done.returncode, done.stderr) == (0, "")

    # when a worker without -Q starts, every lane is served and the acquires are taken
    split.start_worker(concurrency=2)
    client = redis.Redis.from_url(redis_server.url)
    try:
        eventually(lambda: client.llen(acquire) == 0, 120, "the acquires taken")
    finally:
        client.close()
    report, text = status(split, code=0)
    assert report["verdict"] == {"ok": True, "problems": [], "notes": []}
    assert all(row["service"] == "served" for row in report["lanes"]), report["lanes"]
    assert "verdict: ok" in text
    done = health(split)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_no_worker_at_all_is_said_once(split: WorkerStack) -> None:
    # given no worker of this installation, and acquires waiting
    send_acquires()
    report, _ = status(split, code=1)
    # then status says there is no worker, as before, not once more per lane
    assert report["workers"] == []
    worker_problems = [p for p in report["verdict"]["problems"]
                       if p.startswith(("no worker", "lane "))]
    assert len(worker_problems) == 1, report["verdict"]["problems"]
    assert worker_problems[0].startswith("no worker of this installation answers")
    assert lane(report, Lane.ACQUIRE)["waiting"] == WAITING
    assert report["verdict"]["notes"] == []
    done = health(split, "--worker")
    assert done.returncode == 1
    assert done.stderr.startswith("unhealthy worker: no worker of this installation answers")
    assert len(done.stderr.splitlines()) == 1, done.stderr
