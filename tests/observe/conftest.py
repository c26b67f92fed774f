"""Fixtures for what operators see (metrics, alerts, the console): a worker stack of the
module's own (own SQLite store, own task queue, on the session Redis) that this test
process sends its tasks to, and the exporter / console as real subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
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
    from tests.stack import own_queue_stack

    # the first failed destroy abandons the lease
    with own_queue_stack("observe", redis_server.url, tmp_path_factory.mktemp("observe-stack"),
                         {"LEASEKEEPER_CLEANUP_MAX_ATTEMPTS": "1"}) as stack:
        yield stack


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
