"""The warm pools' reads and writes are index-bound on PostgreSQL: on the sweep plans'
history of 20,000 leases plus a pool's own history (5,000 members destroyed, claimed
ones among them), the planner reads no table of leases sequentially for the fill (count
and breaker), the claim (one statement), the drains and the operators' member counts.
The statements are the ones the real PoolStore methods execute, captured as they run."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Connection, text

from models.migrate import upgrade
from models.pool_store import ClaimIntent, DrainRule, FillTarget, PoolStore
from models.store import Store
from tasks.pool_fill import breaker_policy
from tests.services import PostgresServer
from tests.store.history import NOW, load_history, rolled_back
from tests.store.test_sweep_plans import assert_index_bound, run_capturing
from workers.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]
ROWS = 20_000
MEMBERS = """
INSERT INTO leases (lease_id, sandbox_key, live_key, provider, provider_lease_id, backend,
    provider_meta, state, reuse, tenant, run_id, spec, created_at, updated_at,
    acquire_deadline_at, deadline_at, idle_timeout_s, cleanup_attempts, version, pool,
    claimed_at)
SELECT 'm' || lpad(i::text, 10, '0'), 'pool:py:' || i,
    CASE WHEN i > 4990 THEN 'pool:py:' || i END, 'noop', 'lk-m' || i, 'none', '{}',
    CASE WHEN i > 4990 THEN 'warm' ELSE 'destroyed' END, false, 'default',
    CASE WHEN i % 2 = 0 AND i <= 4990 THEN 'r-claimed-' || i END, '{}',
    :now - make_interval(secs => 5000 - i), :now, :now, :now + interval '1 hour', 900, 0,
    1, 'py', CASE WHEN i % 2 = 0 AND i <= 4990 THEN :now END
FROM generate_series(1, 5000) AS i
"""


@pytest.fixture(scope="module")
def history_url(postgres_server: PostgresServer) -> str:
    url = postgres_server.create_database(f"lk_poolplans_{uuid.uuid4().hex[:8]}")
    upgrade(url)
    store = Store(url)
    try:
        load_history(store.engine, ROWS)
        with store.engine.begin() as conn:
            conn.execute(text(MEMBERS), {"now": NOW})
        with store.engine.connect() as plain:
            plain.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                "VACUUM ANALYZE leases")
    finally:
        store.dispose()
    return url


@pytest.fixture
def conn(history_url: str) -> Iterator[Connection]:
    """A connection in a transaction that is rolled back: the claims leave no trace."""
    with rolled_back(history_url) as connection:
        yield connection


def _target() -> FillTarget:
    return FillTarget(pool="py", size=12, max_size=12, batch=2, provider="noop",
                      tenant="default", spec={}, max_age_s=3600, acquire_timeout_s=60,
                      idle_timeout_s=900, name_for=lambda i: f"lk-{i}",
                      new_id=lambda: uuid.uuid4().hex)


def _intent() -> ClaimIntent:
    return ClaimIntent(pool="py", run_id="r-new", sandbox_key="sk-new", tenant="default",
                       thread_id=None, reuse=False, spec={}, acquire_deadline_at=NOW,
                       deadline_at=NOW, idle_timeout_s=900)


POLICY = breaker_policy(Settings())
CALLS: dict[str, Callable[[PoolStore], object]] = {
    "fill": lambda p: p.fill(_target(), POLICY, None).lease_ids,
    "claim": lambda p: p.claim(_intent(), None),
    "drains": lambda p: p.claim_drains(p.due_drains({"py": DrainRule(5, {"x": 1})}, NOW), 300,
                                       None),
    "member_counts": lambda p: p.member_counts(["py"])["py"]["warm"],
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_pool_statement_is_index_bound(conn: Connection, history_url: str, call: str
                                            ) -> None:
    result, statements = run_capturing(conn, history_url,
                                       lambda st: CALLS[call](PoolStore(st)))
    assert result, f"{call} found nothing to do in the seeded history"
    # INSERTs scan nothing (their VALUES are given); everything else must use an index
    assert_index_bound(conn, [(s, p) for s, p in statements
                              if not s.lstrip().upper().startswith("INSERT")])
