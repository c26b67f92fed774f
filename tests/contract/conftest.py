"""The contract tests' parts: a separate virtualenv with only ``celery[redis]`` (a web
backend without leasekeeper), a real worker with events on its own queue, and a real
Flower with basic auth, all on the session's Redis.

The virtualenv is built once per Celery version into ``~/.cache/leasekeeper/`` (made in a
temporary directory there, then renamed, so a half-built one is never used).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import _fresh_store_url
from tests.e2e.conftest import eventually
from tests.services import RedisServer, free_port, stop_process, wait_for_port

if TYPE_CHECKING:  # tests.stack imports the Celery app: only after pytest_configure
    from tests.stack import WorkerStack

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LEASEKEEPER_TEST_CACHE", Path.home() / ".cache" / "leasekeeper"))
CLIENT = Path(__file__).with_name("client.py")
FLOWER_AUTH = "ops:" + uuid.uuid4().hex


def client_venv() -> Path:
    """A virtualenv with ``celery[redis]`` at the project's Celery version, and nothing else."""
    celery_version = version("celery")
    final = CACHE / f"contract-venv-celery-{celery_version}"
    python = final / "bin" / "python"
    if python.exists():
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "contract-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions never build it at once
        if python.exists():
            return python
        building = Path(tempfile.mkdtemp(prefix="contract-venv-", dir=CACHE))
        try:
            subprocess.run([sys.executable, "-m", "venv", str(building)], check=True,
                           capture_output=True)
            subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install",
                            "--quiet", f"celery[redis]=={celery_version}"],
                           check=True, capture_output=True)
            building.rename(final)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return python


@dataclass
class Client:
    """The separate virtualenv's client process, one JSON line per request."""

    proc: subprocess.Popen[str]
    sent: list[str] = field(default_factory=list)  # every task id, for the Flower checks

    def request(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the client exited ({self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, name: str, kwargs: dict[str, Any] | None = None, *,
             args: list[Any] | None = None, wait_s: float = 60, countdown: float | None = None,
             ) -> dict[str, Any]:
        reply = self.request(op="send", name=name, kwargs=kwargs, args=args, wait_s=wait_s,
                             countdown=countdown)
        self.sent.append(reply["id"])
        return reply

    def get(self, task_id: str, wait_s: float = 60) -> dict[str, Any]:
        return self.request(op="get", id=task_id, wait_s=wait_s)


@dataclass
class Flower:
    port: int
    proc: subprocess.Popen[bytes]
    logfile: Path

    def fetch(self, path: str) -> str:
        auth = base64.b64encode(FLOWER_AUTH.encode()).decode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         headers={"Authorization": f"Basic {auth}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return str(resp.read().decode())

    def tasks(self) -> dict[str, Any]:
        return dict(json.loads(self.fetch("/api/tasks")))


@dataclass
class Contract:
    stack: WorkerStack
    client: Client
    flower: Flower
    redis: RedisServer
    queue: str


@contextlib.contextmanager
def start_flower(env: dict[str, str], logfile: Path) -> Iterator[Flower]:
    port = free_port()
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}",
             "--address=127.0.0.1"], env={**env, "FLOWER_BASIC_AUTH": FLOWER_AUTH},
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 60, proc)
        yield Flower(port, proc, logfile)
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def contract(request: pytest.FixtureRequest, redis_server: RedisServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Contract]:
    from tests.stack import WorkerStack

    python = client_venv()
    root = tmp_path_factory.mktemp("contract")
    queue = f"contract-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name="contract", store_url=_fresh_store_url(request, "sqlite", root),
                        root=root, broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    client_env = {k: v for k, v in os.environ.items()
                  if not k.startswith(("LEASEKEEPER_", "PYTHON"))}
    client = Client(subprocess.Popen(
        [str(python), "-I", str(CLIENT), redis_server.url, queue], env=client_env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        stack.start_worker()
        with start_flower(stack.env, root / "flower.log") as flower:
            def flower_listens() -> bool:  # Flower sees events only once it has subscribed
                sent = client.send("leasekeeper.ping", {}, wait_s=10)
                return sent["id"] in flower.tasks()

            eventually(flower_listens, 60, "Flower to receive the worker's task events")
            yield Contract(stack, client, flower, redis_server, queue)
    finally:
        stack.stop()
        if client.proc.poll() is None:
            assert client.proc.stdin is not None
            client.proc.stdin.close()
            client.proc.wait(10)
