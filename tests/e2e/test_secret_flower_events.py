"""A task sent by name through leasekeeper's app (``app.send_task("lease.acquire", ...)``,
as a backend or ``celery call`` does) publishes a task-sent event (task_send_sent_event is
on): Flower shows its arguments until a worker's task-received event replaces them, and
for ever when no worker knows the name. Those arguments must be redacted when they are
sent, not only when a worker receives them. (A process that loads leasekeeper's tasks, as
the producer API does, redacts them; tasks/redaction.py redact_sent_messages.)"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.e2e.conftest import cli_env, eventually
from tests.e2e.test_up import flower_status
from tests.services import RedisServer, free_port
from tests.stack import sending_to

pytestmark = pytest.mark.timeout(300)
AUTH = "ops:a-long-flower-password"
CORE = uuid.uuid4().hex
SECRETS = {"PLAIN": f"plain-{CORE}", "QUOTED": f"q'u\"o\\te-{CORE}",
           "LINES": f"one\ntwo-{CORE}", "UNICODE": f"ünï☃-{CORE}",
           "JSON": json.dumps({"token": f"json-{CORE}"}), "LONG": f"long-{CORE}" * 300}


@pytest.fixture(scope="module")
def flower(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("flower")
    port = free_port()
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_FLOWER_BASIC_AUTH=AUTH, LEASEKEEPER_FLOWER_PORT=str(port))
    with open(tmp_path / "flower.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "flower"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: answering(proc, url), 120, "Flower answering")
        eventually(lambda: capturing_events(url, redis_server), 120, "Flower seeing events")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def answering(proc: subprocess.Popen[bytes], url: str) -> bool:
    assert proc.poll() is None, "Flower exited"
    try:
        return flower_status(url, AUTH) == 200
    except urllib.error.URLError:  # not listening yet
        return False


def capturing_events(url: str, redis_server: RedisServer) -> bool:
    """Flower answers HTTP before it listens to events: a probe sent by name is seen."""
    from workers.app import app

    queue = f"probe-{uuid.uuid4().hex[:8]}"
    with sending_to(queue):
        probe = app.send_task("leasekeeper.probe", kwargs={"probe": True})
    try:
        return _seen(url, probe.id)
    finally:
        _drop_queue(redis_server, queue)


def _seen(url: str, task_id: str) -> bool:
    try:
        eventually(lambda: flower_get(url, f"/api/task/info/{task_id}")[0] == 200, 5, "probe")
    except AssertionError:
        return False
    return True


def _drop_queue(redis_server: RedisServer, queue: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(f"{queue}*"):
        client.delete(key)


def flower_get(url: str, path: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(AUTH.encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""


def seen_by_flower(url: str, task_id: str) -> dict[str, Any]:
    def known() -> dict[str, Any] | None:
        status, body = flower_get(url, f"/api/task/info/{task_id}")
        info: dict[str, Any] = json.loads(body) if status == 200 else {}
        return info if info.get("kwargs") else None
    return eventually(known, 60, f"Flower's record of task {task_id}")


def assert_no_secret(text: str, where: str) -> None:
    for name, value in SECRETS.items():
        for form in {value, json.dumps(value)[1:-1], repr(value)[1:-1], CORE}:
            assert form not in text, f"{name} secret shown in {where}"


@pytest.mark.parametrize("field", ["secret_env", "secretEnv", "secret-env"])
@pytest.mark.parametrize("task_name", ["lease.acquire", "lease.acquier"],
                         ids=["known-name-not-yet-received", "unknown-name"])
def test_a_task_sent_by_name_shows_no_secret_in_flower(
        redis_server: RedisServer, flower: str, task_name: str, field: str) -> None:
    # a misspelt field is refused by validation, but shown until then: hidden the same
    from workers.app import app

    queue = f"secret-events-{uuid.uuid4().hex[:8]}"  # no worker consumes it
    spec = {"tenant": "acme", "env": {"VISIBLE": "shown"}, field: SECRETS}
    with sending_to(queue):
        sent = app.send_task(task_name, kwargs={"run_id": f"{queue}-1", "spec": spec})
    try:
        info = seen_by_flower(flower, sent.id)
        assert "'VISIBLE': 'shown'" in info["kwargs"] and "'PLAIN': '***'" in info["kwargs"]
        assert_no_secret(json.dumps(info), "/api/task/info")
        for path in ["/api/tasks", f"/task/{sent.id}"]:
            status, body = flower_get(flower, path)
            assert status == 200
            assert_no_secret(body, path)
    finally:
        _drop_queue(redis_server, queue)
