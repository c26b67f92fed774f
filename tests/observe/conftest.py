"""Fixtures for what operators see (metrics, alerts, the console): a worker stack of the
module's own (own SQLite store, own task queue, on the session Redis) that this test
process sends its tasks to, and the exporter / console as real subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.services import RedisServer, free_port, stop_process, wait_for_port

if TYPE_CHECKING:  # importing tests.stack creates the Celery app: not before pytest_configure
    from tests.stack import WorkerStack

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def own_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[WorkerStack]:
    from models.migrate import upgrade
    from tests.stack import WorkerStack
    from workers.app import app

    root = tmp_path_factory.mktemp("observe-stack")
    queue = f"observe-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{root / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=queue, store_url=store_url, root=root, broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue,
                                   # the first failed destroy abandons the lease
                                   "LEASEKEEPER_CLEANUP_MAX_ATTEMPTS": "1"})
    previous = app.conf.task_default_queue
    app.conf.task_default_queue = queue
    try:
        stack.start_worker()
        yield stack
    finally:
        app.conf.task_default_queue = previous
        stack.stop()


@contextlib.contextmanager
def leasekeeper_process(stack: WorkerStack, command: str, env: dict[str, str], port: int,
                        log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``leasekeeper <command>`` with the stack's settings, until it listens on ``port``."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", command], cwd=REPO,
                                env={**stack.env, **env}, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 60, proc)
        yield proc
    finally:
        stop_process(proc)


@pytest.fixture
def exporter(own_stack: WorkerStack, tmp_path: Path) -> Iterator[str]:
    """A running `leasekeeper metrics`; yields its host:port."""
    port = free_port()
    env = {"LEASEKEEPER_METRICS_PORT": str(port), "LEASEKEEPER_METRICS_TENANT_TOP_N": "3",
           "LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S": "0.5"}
    with leasekeeper_process(own_stack, "metrics", env, port, tmp_path / "exporter.log"):
        yield f"127.0.0.1:{port}"
