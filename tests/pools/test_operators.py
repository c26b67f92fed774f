"""What operators see of warm pools: the exporter's pool metrics (members by state, size,
breaker, fill failures, claims by result), `leasekeeper pools`, `leases list --state warm
--pool`, `leasekeeper status` (a row per pool; a breaker that stopped a pool needs a
person) and `leasekeeper check`, over a real store (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from models.observe import Observe
from providers.faulty import FaultPlan
from providers.spec import SandboxSpec
from tests.e2e.conftest import cli_env, leasekeeper
from tests.pools.conftest import PoolRecorder, fill, pool
from tests.services import RedisServer
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(240)
POOLS = [pool(size=2, max_size=3), pool("broken", provider="faulty", size=1)]


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(found: dict[Any, float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def busy(runtime_with: Callable[..., Runtime]) -> Runtime:
    """Pool "py" filled, "broken" with its breaker open (its creates always fail)."""
    rt = runtime_with(pools=POOLS, pool_breaker_threshold=1)
    FaultPlan(rt.settings.faults_file).write(  # type: ignore[arg-type]
        {"acquire": [{"fault": "terminal", "times": 100}]})
    fill(rt, PoolRecorder(rt, inline=True, inline_provision=True))
    return rt


def test_the_exporter_counts_members_claims_and_breakers(busy: Runtime) -> None:
    from tasks.acquire import acquire_lease
    from workers.metrics.collector import LeaseCollector, Ping
    from workers.queues import Lane

    rt = busy
    registry = CollectorRegistry()
    registry.register(LeaseCollector(Observe(rt.store), rt.settings,
                                      lambda _t: Ping(1, dict.fromkeys(Lane, 1))))
    before = scrape(registry)  # the exporter counts from its first scrape
    assert sample(before, "leasekeeper_pool_members", pool="py", state="warm") == 2
    assert sample(before, "leasekeeper_pool_members", pool="py", state="provisioning") == 0
    assert sample(before, "leasekeeper_pool_size", pool="py") == 2
    assert sample(before, "leasekeeper_pool_max_size", pool="py") == 3
    assert sample(before, "leasekeeper_pool_breaker_open", pool="py") == 0
    assert sample(before, "leasekeeper_pool_breaker_open", pool="broken") == 1
    assert sample(before, "leasekeeper_pool_fill_failures_total", pool="broken") == 1
    assert sample(before, "leasekeeper_pool_claims_total", pool="py", result="claimed") == 0
    assert sample(before, "leasekeeper_leases", state="warm", provider="local",
                  tenant="default") == 2
    for i in range(3):  # two warm members, then the pool is empty: a cold start
        acquire_lease(rt, f"run-{i}", SandboxSpec(pool="py"), None, False)
    after = scrape(registry)
    assert sample(after, "leasekeeper_pool_claims_total", pool="py", result="claimed") == 2
    assert sample(after, "leasekeeper_pool_claims_total", pool="py", result="fallback") == 1
    assert sample(after, "leasekeeper_pool_members", pool="py", state="warm") == 0
    assert sample(after, "leasekeeper_acquires_total", provider="local", outcome="active") == 3


def test_the_cli_shows_each_pool_its_members_and_its_breaker(
        busy: Runtime, store_url: str, redis_server: RedisServer) -> None:
    env = cli_env(LEASEKEEPER_STORE_URL=store_url, LEASEKEEPER_POOLS=json.dumps(POOLS),
                  LEASEKEEPER_PROVIDERS="local,faulty", LEASEKEEPER_POOL_BREAKER_THRESHOLD="1",
                  LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(busy.settings.var_dir))
    shown = leasekeeper("pools", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows = {r["pool"]: r for r in json.loads(shown.stdout)["pools"]}
    assert (rows["py"]["warm"], rows["py"]["size"], rows["py"]["max_size"]) == (2, 2, 3)
    assert rows["py"]["breaker"] == "closed" and rows["broken"]["breaker"] == "open"
    assert "injected terminal fault" in rows["broken"]["last_error"]
    table = leasekeeper("pools", env=env).stdout
    assert "broken" in table and "open until" in table and "1 in a row" in table

    listed = json.loads(leasekeeper("leases", "list", "--state", "warm", "--pool", "py",
                                    "--json", env=env).stdout)
    assert listed["total"] == 2 and {x["pool"] for x in listed["leases"]} == {"py"}
    assert all(x["run_id"] is None for x in listed["leases"])

    status = leasekeeper("status", "--json", env=env)
    report = json.loads(status.stdout)
    assert report["store"]["leases"]["warm"] == {"local": 2}
    assert [p["pool"] for p in report["pools"]] == ["broken", "py"]
    assert any("warm pool broken stopped creating members" in p
               for p in report["verdict"]["problems"])
    assert status.returncode == 1
    text = leasekeeper("status", env=env).stdout
    assert "pool py: 2 warm of 2 (max 3), 0 provisioning, 0 draining; breaker closed" in text

    checked = leasekeeper("check", env=env)
    assert checked.returncode == 0 and "no violations" in checked.stdout


def test_the_console_shows_warm_members_and_their_pool(busy: Runtime) -> None:
    import asyncio
    import base64

    import httpx

    from models.schema import LeaseState
    from workers.console.app import build_app

    rt = busy
    member = next(lease for lease in rt.store.leases([LeaseState.WARM]) if lease.pool == "py")
    app = build_app(rt.settings, rt.store, "ops", "pw")
    auth = {"Authorization": "Basic " + base64.b64encode(b"ops:pw").decode()}

    async def pages() -> tuple[str, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
            listing = await c.get("/leases?state=warm", headers=auth)
            shown = await c.get(f"/leases/{member.lease_id}", headers=auth)
            assert listing.status_code == shown.status_code == 200
            return listing.text, shown.text

    listing, shown = asyncio.run(pages())
    assert 'id="count-warm">2<' in listing and member.lease_id in listing
    assert "<td>py</td>" in listing
    assert 'id="pool">py (a member, not claimed)' in shown
    assert "waiting for a claim" in shown and 'id="action-destroy"' in shown
