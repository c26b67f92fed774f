"""A broker that refuses the password (wrong, or missing where Redis requires one), against
a real Redis with `requirepass`: the CLI and a starting worker say that authentication
failed and which setting to fix, never "unreachable, start Redis", and never the password.
Before: "is unreachable (invalid username-password pair ...). Start Redis there or fix the
URL", exit 3; the worker retried "Cannot connect" for ever."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import short_error
from tests.services import RedisServer, free_port, start_redis, stop_process
from tests.stack import REPO

pytestmark = pytest.mark.timeout(180)
PASSWORD = "s3cret-broker-pw"


@pytest.fixture(scope="module")
def guarded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("guarded-redis"))
    client = redis.Redis.from_url(server.url)
    client.config_set("requirepass", PASSWORD)
    client.close()
    yield server
    server.stop()


def urls(server: RedisServer) -> dict[str, str]:
    where = f"127.0.0.1:{server.port}/0"
    return {"missing": f"redis://{where}", "wrong": f"redis://:wrong-{PASSWORD}@{where}"}


@pytest.mark.parametrize("password", ["missing", "wrong"])
def test_the_cli_says_authentication_failed(guarded_redis: RedisServer, tmp_path: Path,
                                            password: str) -> None:
    env = cli_env(LEASEKEEPER_BROKER_URL=urls(guarded_redis)[password],
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    done = leasekeeper("health", "--broker", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    err = short_error(done, "authentication failed", "LEASEKEEPER_BROKER_URL")
    assert "unreachable" not in err and "Start Redis" not in err
    assert PASSWORD not in err
    assert ("needs a password" in err) == (password == "missing"), err
    started = leasekeeper("up", env={**env, "LEASEKEEPER_FLOWER_PORT": "0"})
    assert started.returncode == 2, started.stdout + started.stderr  # a setting to fix
    err = short_error(started, "authentication failed", "LEASEKEEPER_BROKER_URL")
    assert PASSWORD not in err


def test_a_worker_with_a_refused_password_exits_saying_so(guarded_redis: RedisServer,
                                                           tmp_path: Path) -> None:
    env = cli_env(LEASEKEEPER_BROKER_URL=urls(guarded_redis)["wrong"],
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    assert leasekeeper("db", "upgrade", env=env).returncode == 0
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.app",
                                   "worker", "-c", "1", "-n", f"auth-{time.monotonic_ns()}@t",
                                   "--without-gossip", "--without-mingle"], cwd=REPO,
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            code = worker.wait(120)  # it exits by itself; a slow host takes its time
        except subprocess.TimeoutExpired:
            code = None
        text = log.read_text()
        assert code == 2, f"the worker did not exit 2 ({code}):\n{text[-3000:]}"
        assert "leasekeeper worker not started" in text and "authentication failed" in text
        assert "LEASEKEEPER_BROKER_URL" in text and PASSWORD not in text
    finally:
        stop_process(worker)


@pytest.mark.parametrize("password", ["missing", "wrong"])
def test_flower_with_a_refused_password_exits_saying_so(guarded_redis: RedisServer,
                                                        tmp_path: Path, password: str) -> None:
    # given Flower's own command and a broker URL whose password Redis refuses; before, it
    # served a dashboard that showed no worker and no task for ever
    env = cli_env(LEASEKEEPER_BROKER_URL=urls(guarded_redis)[password],
                  LEASEKEEPER_VAR_DIR=str(tmp_path),
                  LEASEKEEPER_FLOWER_BASIC_AUTH="ops:flower-pw-1", LEASEKEEPER_FLOWER_PORT="0")
    # when it starts; then it exits 2 at once, naming the setting, never the password
    done = leasekeeper("flower", "--port", str(free_port()), env=env, timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    err = short_error(done, "authentication failed", "LEASEKEEPER_BROKER_URL")
    assert PASSWORD not in err and "flower-pw-1" not in done.stdout + done.stderr


@pytest.mark.timeout(400)
def test_up_never_prints_the_broker_password(guarded_redis: RedisServer, tmp_path: Path) -> None:
    # Before: "leasekeeper is up: broker redis://:s3cret-broker-pw@..." and
    # "export LEASEKEEPER_BROKER_URL=redis://:s3cret-broker-pw@..." on the console (a QA
    # pass); every other command masks it.
    url = f"redis://:{PASSWORD}@127.0.0.1:{guarded_redis.port}/0"
    env = cli_env(LEASEKEEPER_BROKER_URL=url, LEASEKEEPER_FLOWER_PORT="0",
                  LEASEKEEPER_METRICS_PORT="0", LEASEKEEPER_CONSOLE_PORT="0")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--demo", "1",
                           "--exit-after-demo"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert "leasekeeper is up: broker redis://:**@127.0.0.1:" in done.stdout, done.stdout
    # the other shell is told where the whole URL is, not given a masked one to paste
    assert "export LEASEKEEPER_BROKER_URL=" not in done.stdout, done.stdout
    assert "LEASEKEEPER_BROKER_URL holds a password" in done.stdout, done.stdout
