"""In-process lifecycle fixtures: the real task logic over a real store and real local
sandboxes (processes), without the broker in between."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from models.store import Store
from providers.faulty import FaultPlan
from tests.services import RedisServer
from workers.runtime import Runtime
from workers.settings import Settings


@pytest.fixture
def rt(store_url: str, tmp_path: Path, redis_server: RedisServer) -> Iterator[Runtime]:
    # Redis: run.finish reads the run's secret marks there (tasks/secret_marks.py)
    settings = Settings(
        store_url=store_url, var_dir=tmp_path, local_root_dir=tmp_path / "sandboxes",
        providers=["local", "faulty", "noop"], faults_file=tmp_path / "faults.json",
        local_destroy_grace_s=2, cleanup_backoff_s=0, cleanup_max_attempts=3,
        resume_timeout_s=2, claim_timeout_s=5, run_detach_ttl_s=0,
    )
    runtime = Runtime(settings=settings, store=Store(store_url))
    yield runtime
    for name in ("local", "faulty"):
        provider = runtime.provider(name)
        for resource in provider.list_managed():  # never leave a process behind
            from providers.base import LeaseHandle

            provider.destroy(LeaseHandle(resource.name, resource.backend, {}))
    runtime.store.dispose()


@pytest.fixture
def faults(rt: Runtime) -> FaultPlan:
    assert rt.settings.faults_file is not None
    return FaultPlan(rt.settings.faults_file)
