"""Fixtures for the warm pool tests: the real fill, provision and claim code over a real
store (SQLite and PostgreSQL) and real local sandboxes (processes), without the broker in
between; follow-up work recorded, and done inline when asked (provision, destroy)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from models.schema import Lease, LeaseState
from models.store import Store
from providers.base import LeaseHandle
from providers.faulty import FaultPlan
from tests.sweeps.conftest import Recorder
from workers.runtime import Runtime
from workers.settings import Settings

# Task modules import the Celery app, whose broker is fixed only in pytest_configure:
# import them inside functions, never at the top of a conftest.

# A member that waits for its claim, then sources its run's env and records what it saw:
# the sandbox side of the claim contract (README "Warm pools").
WAITING_MEMBER = ["sh", "-c", 'while [ ! -e "$LEASEKEEPER_RUN_DIR/claimed" ]; do sleep 0.05; '
                  'done; set -a; . "$LEASEKEEPER_RUN_DIR/env"; set +a; env > seen.env; '
                  'while :; do sleep 3600; done']


def pool(name: str = "py", size: int = 2, **extra: Any) -> dict[str, Any]:
    return {"name": name, "provider": "local", "size": size, **extra}


@dataclass
class PoolRecorder(Recorder):
    """The sweeps' effects, with pool.provision too (recorded; done inline if asked, as
    the task would: with ``may_retry`` a transient error leaves the member provisioning
    for a retry that never comes here). What a provision raised is kept in ``failed``, as
    Flower would show the task's failure."""

    provisions: list[str] = field(default_factory=list)
    inline_provision: bool = False
    may_retry: bool = False
    failed: list[Exception] = field(default_factory=list)

    def provision(self, lease_id: str) -> None:
        from providers.errors import ProviderError
        from tasks.pool_fill import provision_member

        with self.lock:
            self.provisions.append(lease_id)
        if self.inline_provision:
            try:
                provision_member(self.rt, lease_id, None, may_retry=self.may_retry)
            except ProviderError as exc:
                with self.lock:
                    self.failed.append(exc)


def make_runtime(store_url: str, tmp_path: Path, **overrides: Any) -> Runtime:
    values: dict[str, Any] = dict(
        store_url=store_url, var_dir=tmp_path, local_root_dir=tmp_path / "sandboxes",
        providers=["local", "faulty", "noop"], faults_file=tmp_path / "faults.json",
        local_destroy_grace_s=2, cleanup_backoff_s=0, cleanup_max_attempts=3,
        resume_timeout_s=2, claim_timeout_s=5, run_detach_ttl_s=0, orphan_grace_s=60,
        pool_breaker_threshold=2, pool_breaker_backoff_s=30, pools=[pool()],
    )
    return Runtime(settings=Settings(**{**values, **overrides}), store=Store(store_url))


def destroy_everything(rt: Runtime) -> None:
    for name in ("local", "faulty"):
        provider = rt.provider(name)
        for resource in provider.list_managed():  # never leave a process behind
            provider.destroy(LeaseHandle(resource.name, resource.backend, {}))


@pytest.fixture
def runtime_with(store_url: str, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    """Runtimes with these settings over the test's store (same sandboxes); each cleaned
    up afterwards."""
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
def postgres_runtime(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Runtime]:
    """A runtime over a fresh PostgreSQL store only (for what only PostgreSQL has: row
    locks), with the default pool."""
    import uuid

    from models.migrate import upgrade

    server = request.getfixturevalue("postgres_server")
    url = server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(url)
    runtime = make_runtime(url, tmp_path, pools=[pool(size=2, template={
        "command": WAITING_MEMBER})])
    yield runtime
    destroy_everything(runtime)
    runtime.store.dispose()


@pytest.fixture
def rt(runtime_with: Callable[..., Runtime]) -> Runtime:
    return runtime_with()


@pytest.fixture
def effects(rt: Runtime) -> PoolRecorder:
    return PoolRecorder(rt, inline=True, inline_provision=True)


@pytest.fixture
def faults(rt: Runtime) -> FaultPlan:
    assert rt.settings.faults_file is not None
    return FaultPlan(rt.settings.faults_file)


def fill(rt: Runtime, effects: PoolRecorder) -> dict[str, int]:
    """One tick of sweep.fill_pools (no lock: the body), its counts."""
    from tasks.pool_fill import fill_pools
    from tasks.sweeping import SweepContext

    return dict(fill_pools(SweepContext(rt, effects)).counts)


def members(rt: Runtime, pool_name: str = "py", *states: str) -> list[Lease]:
    """The pool's unclaimed members (no run), oldest first; only in ``states`` if given."""
    return [lease for lease in rt.store.leases(states or None)
            if lease.pool == pool_name and lease.run_id is None]


def warm(rt: Runtime, pool_name: str = "py") -> list[Lease]:
    return members(rt, pool_name, LeaseState.WARM)


def sandboxes(rt: Runtime, provider: str = "local") -> set[str]:
    """The names of the sandboxes the provider really has (processes and workspaces)."""
    return {r.name for r in rt.provider(provider).list_managed()}


