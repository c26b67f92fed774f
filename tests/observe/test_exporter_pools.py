"""What the real exporter (`leasekeeper metrics`, scraped over HTTP) says about warm pools,
over a real store (SQLite and PostgreSQL), real local sandboxes and the test Redis:

- a claimed member's acquire is measured from its claim, not from when the member was
  made (its warm age is no acquire latency: AcquireLatencyHigh must not fire for it); a
  cold start still from its intent;
- a pool removed from the settings keeps its series only while members of it exist: no
  all-zero (or open-breaker) series for it forever;
- a member whose create failed is the pool's failure, not a failed acquire (no run asked
  for it: AcquireFailureRateHigh must not fire for a failing pool);
- a template the provider refuses counts as the pool's fill failures and opens its
  breaker, so PoolBreakerOpen fires on the real scrape (replayed to promtool).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from models.schema import Lease, LeaseState
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tests.e2e.conftest import eventually
from tests.observe.exporter import Exporter, Samples, running_exporter
from tests.pools.conftest import PoolRecorder, destroy_everything, fill, make_runtime, pool
from tests.services import RedisServer
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)
# How long the members had waited warm before their claims (a quiet pool's wait that long
# and more): over AcquireLatencyHigh's 60 s.
WARM_AGE = timedelta(seconds=90)


@pytest.fixture
def runtimes(store_url: str, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    """Runtimes with these settings over the test's store, as tests/pools' runtime_with."""
    made: list[Runtime] = []

    def make(**overrides: Any) -> Runtime:
        made.append(make_runtime(store_url, tmp_path, **overrides))
        return made[-1]

    yield make
    for rt in made:
        destroy_everything(rt)
        rt.store.dispose()


@pytest.fixture
def exporter_for(store_url: str, tmp_path: Path, redis_server: RedisServer
                 ) -> Iterator[Callable[[list[dict[str, Any]]], Exporter]]:
    """Starts `leasekeeper metrics` on the test's store, declaring these pools."""
    with contextlib.ExitStack() as started:
        def start(pools: list[dict[str, Any]]) -> Exporter:
            return started.enter_context(running_exporter(
                tmp_path / "exporter.log", LEASEKEEPER_STORE_URL=store_url,
                LEASEKEEPER_BROKER_URL=redis_server.url,
                LEASEKEEPER_PROVIDERS="local,faulty,noop", LEASEKEEPER_POOLS=json.dumps(pools),
                LEASEKEEPER_VAR_DIR=str(tmp_path / "var")))

        yield start


def test_a_claim_is_measured_from_its_claim_and_a_cold_start_from_its_intent(
        runtimes: Callable[..., Runtime],
        exporter_for: Callable[[list[dict[str, Any]]], Exporter]) -> None:
    from tasks.acquire import acquire_lease

    rt = runtimes(pools=[pool(size=2)])
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    members = [m for m in rt.store.leases([LeaseState.WARM]) if m.pool == "py"]
    assert len(members) == 2
    with rt.store.tx() as s:  # made WARM_AGE ago: they have waited that long for a run
        for member in members:
            s.execute(update(Lease).where(Lease.lease_id == member.lease_id)
                      .values(created_at=member.created_at - WARM_AGE))
    exporter = exporter_for([pool(size=2)])
    assert exporter.scrape().value("leasekeeper_store_up") == 1  # counting from here

    # two claims, then the pool is empty: a cold start (fallback)
    leases = [acquire_lease(rt, f"run-{i}", SandboxSpec(pool="py"), None, False).lease_id
              for i in range(3)]

    def counted() -> Samples | None:
        samples = exporter.scrape()
        done = samples.total("leasekeeper_acquire_duration_seconds_count", provider="local")
        return samples if done == 3 else None

    seen = eventually(counted, 60, "the three acquires to be counted")
    assert seen.value("leasekeeper_pool_claims_total", pool="py", result="claimed") == 2

    # each measured from its last entry into provisioning (the claim; a cold start's
    # intent) to active, as its history shows
    expected_s = 0.0
    for lease_id in leases:
        events = rt.store.events(lease_id)
        active = next(e for e in events if e.to_state == LeaseState.ACTIVE)
        start = [e for e in events if e.to_state == LeaseState.PROVISIONING
                 and e.id < active.id][-1]
        expected_s += (active.at - start.at).total_seconds()
    assert seen.total("leasekeeper_acquire_duration_seconds_sum",
                      provider="local") == pytest.approx(expected_s, abs=1e-3)
    assert seen.total("leasekeeper_acquire_duration_seconds_bucket", provider="local",
                      le="60.0") == 3  # none near the members' warm age


def test_a_removed_pool_keeps_its_series_only_while_it_has_members(
        runtimes: Callable[..., Runtime],
        exporter_for: Callable[[list[dict[str, Any]]], Exporter]) -> None:
    # "py" has a warm member; "broken" none (the one it made failed and was destroyed) and
    # its breaker open: a series for it would say open forever (PoolBreakerOpen)
    rt = runtimes(pools=[pool(size=1), pool("broken", provider="faulty", size=1)],
                  pool_breaker_threshold=1)
    FaultPlan(rt.settings.faults_file).write(  # type: ignore[arg-type]
        {"acquire": [{"fault": "terminal", "times": 100}]})
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    pool_series = ("leasekeeper_pool_members", "leasekeeper_pool_breaker_open",
                   "leasekeeper_pool_fill_failures_total")

    def pools_shown(samples: Samples) -> list[set[str]]:
        return [samples.labels(name, "pool") for name in pool_series]

    # Both removed from the settings; "fresh" declared (nothing made yet).
    exporter = exporter_for([pool("fresh", size=1)])
    first = exporter.scrape()
    assert pools_shown(first) == [{"fresh", "py"}] * 3
    assert first.value("leasekeeper_pool_members", pool="py", state="warm") == 1
    assert first.value("leasekeeper_pool_breaker_open", pool="fresh") == 0

    # When the removed pool's last member is drained, its series go too.
    gone = runtimes(pools=[])
    assert fill(gone, PoolRecorder(gone, inline=True))["removed"] == 1
    assert rt.store.leases([LeaseState.WARM]) == []
    assert pools_shown(exporter.scrape()) == [{"fresh"}] * 3


def test_a_failed_member_create_is_no_failed_acquire(
        runtimes: Callable[..., Runtime],
        exporter_for: Callable[[list[dict[str, Any]]], Exporter]) -> None:
    from tasks.acquire import acquire_lease

    exporter = exporter_for([pool("broken", provider="faulty", size=2)])
    assert exporter.scrape().value("leasekeeper_store_up") == 1  # counting from here
    rt = runtimes(pools=[pool("broken", provider="faulty", size=2)])
    FaultPlan(rt.settings.faults_file).write(  # type: ignore[arg-type]
        {"acquire": [{"fault": "terminal", "times": 2}]})
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    # and one run's own acquire that succeeds (the pool is empty: a cold start)
    acquire_lease(rt, "run-cold", SandboxSpec(pool="broken"), None, False)

    def counted() -> Samples | None:
        samples = exporter.scrape()
        return samples if samples.total("leasekeeper_acquires_total") == 1 else None

    seen = eventually(counted, 60, "the run's acquire to be counted")
    assert seen.value("leasekeeper_pool_fill_failures_total", pool="broken") == 2
    assert seen.total("leasekeeper_acquires_total", outcome="failed") == 0
    assert seen.total("leasekeeper_acquires_total", outcome="active") == 1


def test_a_refused_template_counts_as_fill_failures_and_its_alert_fires(
        runtimes: Callable[..., Runtime],
        exporter_for: Callable[[list[dict[str, Any]]], Exporter], tmp_path: Path) -> None:
    """QA: a pool whose command does not exist scraped breaker 0, failures 0: no alert."""
    from tests.observe.test_alerts_on_real_scrapes import fired

    nocmd = [pool("nocmd", size=1, template={"command": ["nosuchcmd-xyz"]})]
    exporter = exporter_for(nocmd)
    rt = runtimes(pools=nocmd, pool_breaker_threshold=3)  # the exporter's default
    for _ in range(3):
        assert fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))[
            "template_refused"] == 1

    def opened() -> Samples | None:
        samples = exporter.scrape()
        return samples if samples.value("leasekeeper_pool_breaker_open", pool="nocmd") else None

    seen = eventually(opened, 60, "the exporter to see the breaker open")
    assert seen.value("leasekeeper_pool_fill_failures_total", pool="nocmd") == 3
    assert seen.total("leasekeeper_acquires_total", outcome="failed") == 0  # no run's
    series = {key: value for key, value in seen.found.items()
              if key[0].startswith("leasekeeper_") and not key[0].endswith("_created")}
    assert fired(series, "PoolBreakerOpen", tmp_path)
