"""A real leasekeeper stack for end-to-end tests: a Celery worker subprocess on the test
Redis, with its own store (SQLite or PostgreSQL), local sandbox root and fault plan.

The test process talks to it the way a web backend would (the producer API over the
broker) and reads the same store directly to assert on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from models.store import Store
from providers.faulty import FaultPlan
from workers.app import app
from workers.runtime import Runtime
from workers.settings import Settings

REPO = Path(__file__).resolve().parent.parent

# Fast, deterministic policy for tests: few retries, short backoffs, short claims.
TEST_SETTINGS: dict[str, str] = {
    "LEASEKEEPER_PROVIDERS": "local,noop,faulty",
    "LEASEKEEPER_TASK_MAX_RETRIES": "2",
    "LEASEKEEPER_RETRY_BACKOFF_BASE_S": "0.2",
    "LEASEKEEPER_RETRY_BACKOFF_MAX_S": "0.5",
    "LEASEKEEPER_CLEANUP_BACKOFF_S": "0",
    "LEASEKEEPER_CLEANUP_MAX_ATTEMPTS": "3",
    "LEASEKEEPER_CLAIM_TIMEOUT_S": "3",
    "LEASEKEEPER_LOCAL_DESTROY_GRACE_S": "2",
    "LEASEKEEPER_RUN_DETACH_TTL_S": "1",
    "LEASEKEEPER_RESUME_TIMEOUT_S": "5",
    "LEASEKEEPER_ACQUIRE_TIMEOUT_S": "30",
}


@dataclass
class WorkerStack:
    name: str
    store_url: str
    root: Path
    broker_url: str
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. another provider's settings
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    node: int = 0

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        return {**env, **TEST_SETTINGS, "LEASEKEEPER_BROKER_URL": self.broker_url,
                "LEASEKEEPER_STORE_URL": self.store_url,
                "LEASEKEEPER_VAR_DIR": str(self.root),
                "LEASEKEEPER_LOCAL_ROOT_DIR": str(self.root / "sandboxes"),
                "LEASEKEEPER_FAULTS_FILE": str(self.root / "faults.json"),
                "PYTHONPATH": str(REPO), **self.extra_env}

    def settings(self, **overrides: Any) -> Settings:
        values = {k.removeprefix("LEASEKEEPER_").lower(): v for k, v in self.env.items()
                  if k.startswith("LEASEKEEPER_")}
        return Settings(**{**values, **overrides})

    def runtime(self, **overrides: Any) -> Runtime:
        return Runtime(settings=self.settings(**overrides), store=Store(self.store_url))

    @property
    def faults(self) -> FaultPlan:
        return FaultPlan(self.root / "faults.json")

    @property
    def logfile(self) -> Path:
        return self.root / "worker.log"

    def start_worker(self, concurrency: int = 2, queues: list[str] | None = None
                     ) -> subprocess.Popen[bytes]:
        return self.await_worker(self.spawn_worker(concurrency, queues))

    def spawn_worker(self, concurrency: int = 2, queues: list[str] | None = None
                     ) -> subprocess.Popen[bytes]:
        """Start a worker without waiting for it (``await_worker`` waits); ``queues`` is its
        ``-Q`` (unset: every queue of the installation)."""
        self.node += 1
        only = ["-Q", ",".join(queues)] if queues else []
        with open(self.logfile, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P", "prefork",
                 "-c", str(concurrency), "-E", "-n", self.hostname(self.node), *only,
                 "--without-gossip", "--without-mingle", "-l", "info"],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def hostname(self, node: int) -> str:
        return f"{self.name}-{node}@test"

    def await_worker(self, proc: subprocess.Popen[bytes], client: Celery | None = None
                     ) -> subprocess.Popen[bytes]:
        """Wait until the worker ``proc`` (from spawn_worker) answers a ping (sent through
        ``client``, a Celery app on this stack's broker; the session's app by default)."""
        hostname = self.hostname(self.procs.index(proc) + 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited ({proc.returncode}); see {self.logfile}")
            with contextlib.suppress(Exception):  # a broker still coming back
                if (client or app).control.ping(destination=[hostname], timeout=0.5):
                    return proc
                continue
            time.sleep(0.2)
        raise TimeoutError(f"worker {hostname} did not answer a ping in 60 s")

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the whole worker (parent and pool children), as a crash would."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)


@contextlib.contextmanager
def sending_to(queue: str) -> Iterator[None]:
    """This test process sends tasks to ``queue``'s lanes while the block runs."""
    previous = app.conf.task_default_queue
    app.conf.task_default_queue = queue
    try:
        yield
    finally:
        app.conf.task_default_queue = previous


@contextlib.contextmanager
def own_queue_stack(prefix: str, broker_url: str, root: Path,
                    extra_env: dict[str, str] | None = None) -> Iterator[WorkerStack]:
    """A worker on a fresh SQLite store and an installation queue of its own; this test
    process sends to it while the block runs."""
    from models.migrate import upgrade

    queue = f"{prefix}-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{root / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name=queue, store_url=store_url, root=root, broker_url=broker_url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue, **(extra_env or {})})
    with sending_to(queue):
        try:
            stack.start_worker()
            yield stack
        finally:
            stack.stop()
