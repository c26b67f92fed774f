"""Fixtures for the sweep tests: the real sweep bodies over a real store (SQLite and
PostgreSQL) and real local sandboxes, with follow-up work recorded (or done inline)
instead of enqueued, so each edge case is exact and needs no broker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from models.store import Store
from providers.base import LeaseHandle
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tests.services import RedisServer
from workers.runtime import Runtime
from workers.settings import Settings

# Task modules import the Celery app, whose broker is fixed only in pytest_configure:
# import them inside functions, never at the top of a conftest.


@dataclass
class Recorder:
    """The sweeps' Effects: records every follow-up; with ``inline``, also does it."""

    rt: Runtime
    inline: bool = False
    reclaims: list[str] = field(default_factory=list)
    destroys: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reclaim(self, run_id: str) -> None:
        with self.lock:
            self.reclaims.append(run_id)
        if self.inline:
            from tasks.reclaim import reclaim_run

            reclaim_run(self.rt, run_id, None)

    def destroy(self, lease_id: str, reason: str) -> None:
        with self.lock:
            self.destroys.append((lease_id, reason))
        if self.inline:
            from tasks.destroy import destroy_lease

            destroy_lease(self.rt, lease_id, reason, None)


def make_runtime(store_url: str, tmp_path: Path, **overrides: Any) -> Runtime:
    values: dict[str, Any] = dict(
        store_url=store_url, var_dir=tmp_path, local_root_dir=tmp_path / "sandboxes",
        providers=["local", "faulty", "noop"], faults_file=tmp_path / "faults.json",
        local_destroy_grace_s=2, cleanup_backoff_s=0, cleanup_max_attempts=3,
        resume_timeout_s=2, claim_timeout_s=5, run_detach_ttl_s=0, orphan_grace_s=60,
    )
    return Runtime(settings=Settings(**{**values, **overrides}), store=Store(store_url))


def destroy_everything(rt: Runtime) -> None:
    for name in ("local", "faulty"):
        provider = rt.provider(name)
        for resource in provider.list_managed():  # never leave a process behind
            provider.destroy(LeaseHandle(resource.name, resource.backend, {}))


@pytest.fixture
def rt(store_url: str, tmp_path: Path, redis_server: RedisServer) -> Iterator[Runtime]:
    # Redis: a run finished with an error reads the run's secret marks there
    # (tasks/secret_marks.py); without it a file run alone failed those finishes
    runtime = make_runtime(store_url, tmp_path)
    yield runtime
    (tmp_path / "faults.json").unlink(missing_ok=True)
    destroy_everything(runtime)
    runtime.store.dispose()


@pytest.fixture
def runtime_with(store_url: str, tmp_path: Path, redis_server: RedisServer
                 ) -> Iterator[Callable[..., Runtime]]:
    """Runtimes with other settings, over the test's store; each cleaned up afterwards."""
    made: list[Runtime] = []

    def make(**overrides: Any) -> Runtime:
        made.append(make_runtime(store_url, tmp_path, **overrides))
        return made[-1]

    yield make
    (tmp_path / "faults.json").unlink(missing_ok=True)
    for runtime in made:
        destroy_everything(runtime)
        runtime.store.dispose()


@pytest.fixture
def effects(rt: Runtime) -> Recorder:
    return Recorder(rt)


@pytest.fixture
def faults(rt: Runtime) -> FaultPlan:
    assert rt.settings.faults_file is not None
    return FaultPlan(rt.settings.faults_file)


def acquire(rt: Runtime, run_id: str, **spec: Any) -> str:
    from tasks.acquire import acquire_lease

    return acquire_lease(rt, run_id, SandboxSpec.model_validate(spec), None, False).lease_id


def concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Start every call at the same moment (a barrier), return their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def set_lease(rt: Runtime, lease_id: str, **values: Any) -> None:
    """Write lease columns directly (to place deadlines exactly; behind the system's back)."""
    from sqlalchemy import update

    from models.schema import Lease

    with rt.store.tx() as s:
        s.execute(update(Lease).where(Lease.lease_id == lease_id).values(**values))


def set_run(rt: Runtime, run_id: str, **values: Any) -> None:
    from sqlalchemy import update

    from models.schema import Run

    with rt.store.tx() as s:
        s.execute(update(Run).where(Run.run_id == run_id).values(**values))


def events_to(rt: Runtime, lease_id: str, state: str, containing: str = "") -> int:
    """How many of the lease's events moved it to ``state`` (with ``containing`` in the reason)."""
    return sum(1 for e in rt.store.events(lease_id)
               if e.to_state == state and containing in e.reason)
