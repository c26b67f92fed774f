"""The producer in a web process that sets only the broker URL (and the queue): it must
not refuse the workers' providers because of its own default LEASEKEEPER_PROVIDERS; it
refuses only names no leasekeeper has, unless the web process sets the list itself."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import cli_env
from tests.services import RedisServer

pytestmark = pytest.mark.timeout(120)

SEND = """
import sys
from providers.errors import InvalidRequest
from tasks import producer
try:
    producer.acquire_lease(sys.argv[1], {"provider": sys.argv[2]})
    print("sent")
except InvalidRequest as exc:
    print(f"refused: {exc}")
"""


def web_send(redis_server: RedisServer, cwd: Path, provider: str, **settings: str) -> str:
    queue = f"web-{uuid.uuid4().hex[:8]}"  # no worker consumes it
    env = cli_env(LEASEKEEPER_BROKER_URL=redis_server.url, LEASEKEEPER_TASK_QUEUE=queue,
                  **settings)
    try:
        done = subprocess.run([sys.executable, "-c", SEND, f"run-{uuid.uuid4().hex[:8]}",
                               provider], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=90, check=False)
    finally:
        client = redis.Redis.from_url(redis_server.url)
        for key in client.scan_iter(f"{queue}*"):
            client.delete(key)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("provider", ["kubernetes", "local", "noop"])
def test_a_web_process_without_a_provider_list_sends_any_known_provider(
        redis_server: RedisServer, tmp_path: Path, provider: str) -> None:
    assert web_send(redis_server, tmp_path, provider) == "sent"


def test_a_web_process_refuses_a_provider_no_leasekeeper_has(
        redis_server: RedisServer, tmp_path: Path) -> None:
    said = web_send(redis_server, tmp_path, "kubernets")
    assert said.startswith("refused: unknown provider 'kubernets'")
    assert "kubernetes" in said  # it names the ones there are
    # ...that a user may name: not the fault injection of leasekeeper's own tests (before,
    # "leasekeeper has the providers local, kubernetes, noop, faulty": a QA pass)
    assert "local, kubernetes, noop;" in said and "faulty" not in said


def test_a_web_process_that_sets_the_provider_list_keeps_to_it(
        redis_server: RedisServer, tmp_path: Path) -> None:
    # a provider leasekeeper has is not "unknown" (that sends one looking for a typo): it
    # is not enabled here, and the message names the setting that enables it (before,
    # "unknown provider 'kubernetes': this installation enables local": a QA pass)
    said = web_send(redis_server, tmp_path, "kubernetes", LEASEKEEPER_PROVIDERS="local")
    assert said == ("refused: provider 'kubernetes' is not enabled on this process (it "
                    "enables local): add it to LEASEKEEPER_PROVIDERS, here and on the "
                    "workers, to use it")
    said = web_send(redis_server, tmp_path, "nomad", LEASEKEEPER_PROVIDERS="local")
    assert said == ("refused: unknown provider 'nomad': this installation enables local "
                    "(LEASEKEEPER_PROVIDERS)")
