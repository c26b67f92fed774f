"""What the worker benchmarks share: their services (Redis, a store), a real worker with
the ``noop`` provider (tests/stack.py's WorkerStack), and process-tree measurements.

Import this before anything from ``workers`` or ``tasks``: it fixes the broker URL first,
because workers.app builds its Celery app on import.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import (  # noqa: E402
    PostgresServer,
    RedisServer,
    free_port,
    start_postgres,
    start_redis,
)

WORK = Path(tempfile.mkdtemp(prefix="lk-bench-"))
WORK.chmod(0o755)
_REDIS_PORT = free_port()
os.environ["LEASEKEEPER_BROKER_URL"] = f"redis://127.0.0.1:{_REDIS_PORT}/0"
os.environ["LEASEKEEPER_PROVIDERS"] = "noop,local"
os.environ["LEASEKEEPER_PROVIDER"] = "noop"
NOOP_ENV = {"LEASEKEEPER_PROVIDER": "noop", "LEASEKEEPER_PROVIDERS": "noop,local"}


@dataclass
class Services:
    broker_url: str
    redis: RedisServer
    postgres: PostgresServer | None

    def store_url(self, kind: str) -> str:
        """A fresh, migrated store of ``kind`` (sqlite or postgres)."""
        from models.migrate import upgrade

        name = f"bench_{uuid.uuid4().hex[:8]}"
        if kind == "sqlite":
            url = f"sqlite:///{WORK / (name + '.db')}"
        else:
            if self.postgres is None:
                self.postgres = start_postgres(WORK / "postgres")
            url = self.postgres.create_database(name)
        upgrade(url)
        return url


@contextlib.contextmanager
def services() -> Iterator[Services]:
    redis = start_redis(WORK / "redis", _REDIS_PORT)
    found = Services(os.environ["LEASEKEEPER_BROKER_URL"], redis, None)
    try:
        yield found
    finally:
        if found.postgres:
            found.postgres.stop()
        redis.stop()


@contextlib.contextmanager
def noop_stack(svc: Services, store_url: str, name: str) -> Iterator[object]:
    """A WorkerStack (no worker started yet) on the noop provider; every worker it starts
    is stopped on the way out."""
    import redis as redis_lib

    from tests.stack import WorkerStack

    redis_lib.Redis.from_url(svc.broker_url).flushdb()
    stack = WorkerStack(name=name, store_url=store_url, root=WORK / name,
                        broker_url=svc.broker_url, extra_env=dict(NOOP_ENV))
    stack.root.mkdir(parents=True, exist_ok=True)
    os.environ["LEASEKEEPER_STORE_URL"] = store_url
    try:
        yield stack
    finally:
        stack.stop()


def pairs(count: int, prefix: str = "b") -> None:
    """``count`` acquire+destroy pairs through the producer API, acquires all sent first."""
    from tasks import producer

    acquired = [producer.acquire_lease(f"{prefix}-{uuid.uuid4().hex[:12]}")
                for _ in range(count)]
    ids = [r.get(300)["lease_id"] for r in acquired]
    for r in [producer.destroy_lease(lease_id) for lease_id in ids]:
        r.get(300)


def p50_ms(samples_s: list[float]) -> float:
    return round(statistics.median(samples_s) * 1000, 2)


def tree(pid: int) -> list[psutil.Process]:
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    """User+system CPU seconds so far of each process in the trees of ``pids``."""
    found: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in tree(pid):
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = proc.cpu_times()
                    found[proc.pid] = times.user + times.system
    return found


def cpu_since(before: dict[int, float], pids: list[int]) -> float:
    """CPU seconds the trees of ``pids`` used since ``before`` (processes that exited in
    between are not counted)."""
    now = cpu_by_pid(pids)
    return sum(used - before.get(pid, 0.0) for pid, used in now.items())


def rss_mb(proc: psutil.Process) -> float:
    return round(proc.memory_info().rss / 2**20, 1)
