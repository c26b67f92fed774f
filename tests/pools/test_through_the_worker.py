"""Warm pools as Celery runs them: a real worker (prefork, its own queue and store: SQLite
and PostgreSQL), real celery beat driving sweep.fill_pools, claims through the producer
API, a burst of claims with the store sampled all along (never above max_size), a pool
whose creates fail (its breaker opens and the summary says so), a pool whose template the
provider refuses (a failure on its breaker: `leasekeeper pools` and `status` name it), and
no secret value in the store, the worker's log, Redis or any result."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from models.pool_store import BreakerState, PoolStore
from models.schema import LeaseState, utcnow
from tasks import producer
from tests.contract.test_by_name import redis_dump, store_dump
from tests.e2e.conftest import eventually, leasekeeper
from tests.pools.conftest import WAITING_MEMBER
from tests.services import RedisServer
from tests.stack import WorkerStack, sending_to
from tests.sweeps.beats import beats
from workers.app import app

pytestmark = pytest.mark.timeout(400)
POOLS = [{"name": "py", "provider": "local", "size": 3, "max_size": 4, "fill_batch_size": 4,
          "template": {"command": WAITING_MEMBER}},
         {"name": "broken", "provider": "faulty", "size": 2},
         # a template the provider refuses (no such command): it can never make a member
         {"name": "nocmd", "provider": "local", "size": 1,
          "template": {"command": ["nosuchcmd-xyz"]}}]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres",
                                                               marks=pytest.mark.postgres)])
def pool_stack(request: pytest.FixtureRequest, redis_server: RedisServer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerStack]:
    """A worker on a queue and store of its own, with the pools declared; the "broken"
    pool's creates always fail (the faulty provider, planned before the worker starts)."""
    from tests.conftest import _fresh_store_url

    root = tmp_path_factory.mktemp(f"pools-{request.param}")
    queue = f"pools-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=_fresh_store_url(request, str(request.param),
                                                                root),
                        root=root, broker_url=redis_server.url, extra_env={
                            "LEASEKEEPER_TASK_QUEUE": queue,
                            "LEASEKEEPER_POOLS": json.dumps(POOLS),
                            "LEASEKEEPER_POOL_BREAKER_THRESHOLD": "2",
                            "LEASEKEEPER_POOL_BREAKER_BACKOFF_S": "600"})
    stack.faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 10_000}]})
    with sending_to(queue):
        try:
            stack.start_worker()
            yield stack
        finally:
            stack.stop()
            from tests.pools.conftest import destroy_everything

            destroy_everything(stack.runtime())


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def warm_count(stack: WorkerStack, pool: str = "py") -> int:
    return PoolStore(stack.runtime().store).member_counts([pool])[pool][LeaseState.WARM]


def seen_env(stack: WorkerStack, lease_id: str) -> dict[str, str]:
    workspace = Path(stack.runtime().store.get_lease(lease_id).provider_meta["workspace"])
    seen = workspace / "work" / "seen.env"
    eventually(lambda: seen.exists() and seen.read_text().endswith("\n"), 30,
               "the sandbox to read its run's env")
    return dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)


def test_beat_fills_the_pool_and_a_claim_through_the_worker_answers_claimed(
        pool_stack: WorkerStack) -> None:
    rt = pool_stack.runtime()
    secret = f"tok-{uuid.uuid4().hex}"
    with beats(pool_stack.env, pool_stack.root, 1, interval_s=1.0, tag=rid("beat")):
        eventually(lambda: warm_count(pool_stack) == 3, 120, "beat to fill the pool to 3")
        run_id = rid("claim")
        done = producer.acquire_lease(run_id, {"pool": "py", "env": {"A": "1"},
                                               "secret_env": {"API_TOKEN": secret}}).get(60)
        assert done["result"] == "claimed" and done["state"] == "active"
        assert seen_env(pool_stack, done["lease_id"])["API_TOKEN"] == secret
        eventually(lambda: warm_count(pool_stack) == 3, 120, "beat to refill the pool")
        producer.finish_run(run_id, "completed", 0).get(30)
        eventually(lambda: rt.store.get_lease(done["lease_id"]).state == LeaseState.DESTROYED,
                   60, "the claimed member reclaimed")
    lease = rt.store.get_lease(done["lease_id"])
    assert lease.pool == "py" and lease.claimed_at is not None
    # the secret reached that sandbox and nothing else
    places = {"store": store_dump(pool_stack.store_url),
              "worker log": pool_stack.logfile.read_text(errors="replace"),
              "redis (broker, results)": redis_dump(pool_stack.broker_url),
              "result": json.dumps(done)}
    assert "API_TOKEN" in places["store"]
    leaks = [where for where, text in places.items() if secret in text]
    assert not leaks, f"the secret value is in {leaks}"


def test_a_burst_of_claims_never_takes_a_pool_above_max_size(pool_stack: WorkerStack) -> None:
    rt = pool_stack.runtime()
    pools = PoolStore(rt.store)
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sum(pools.member_counts(["py"])["py"].values()))
            time.sleep(0.01)

    with beats(pool_stack.env, pool_stack.root, 1, interval_s=1.0, tag=rid("beat")):
        eventually(lambda: warm_count(pool_stack) == 3, 120, "the pool filled")
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            sent = [producer.acquire_lease(rid("burst"), {"pool": "py"}) for _ in range(8)]
            results: list[dict[str, Any]] = [r.get(120) for r in sent]
            eventually(lambda: warm_count(pool_stack) == 3, 120, "the pool refilled")
        finally:
            stop.set()
            sampler.join(30)
    claimed = [r for r in results if r["result"] == "claimed"]
    assert {r["result"] for r in results} <= {"claimed", "acquired"} and claimed
    assert len({r["lease_id"] for r in results}) == 8
    assert seen and max(seen) <= 4, max(seen)
    for result in results:
        producer.destroy_lease(result["lease_id"]).get(60)


def test_a_pool_whose_creates_fail_opens_its_breaker_and_reports_it(
        pool_stack: WorkerStack) -> None:
    rt = pool_stack.runtime()
    pools = PoolStore(rt.store)

    def breaker_open() -> bool:
        found = pools.breakers().get("broken")
        return found is not None and found.state(2, utcnow()) == BreakerState.OPEN

    if not breaker_open():  # earlier tests' beats may have opened it already
        first = app.send_task("sweep.fill_pools").get(60)
        assert first["run"] in {"ran", "skipped"}
        eventually(breaker_open, 60, "the broken pool's breaker to open")
    summary: dict[str, Any] = {}

    def ran() -> bool:
        summary.update(app.send_task("sweep.fill_pools").get(60))
        return summary["run"] == "ran"

    eventually(ran, 60, "a fill tick that ran (not skipped)")
    broken = [i for i in summary["items"] if i.startswith("breaker_open broken (")]
    assert len(broken) == 1 and "injected terminal fault" in broken[0], summary["items"]
    members = [lease for lease in rt.store.leases() if lease.pool == "broken"]
    assert members and all(m.end_reason == "acquire_failed" for m in members)
    eventually(lambda: all(rt.store.get_lease(m.lease_id).state == LeaseState.DESTROYED
                           for m in members), 60, "every failed member destroyed")
    assert rt.provider("faulty").list_managed() == []  # nothing left, nothing multiplied
    assert len(members) <= 3  # two created at once, then at most one probe: never more


def test_a_pool_whose_template_is_refused_opens_its_breaker_and_status_names_it(
        pool_stack: WorkerStack) -> None:
    """QA: a pool whose command does not exist looked healthy everywhere (breaker closed,
    no last error, status ok) but in the worker's log; every run asking it failed."""
    pools = PoolStore(pool_stack.runtime().store)

    def breaker_open() -> bool:
        found = pools.breakers().get("nocmd")
        return found is not None and found.state(2, utcnow()) == BreakerState.OPEN

    def ticked_until_open() -> bool:
        app.send_task("sweep.fill_pools").get(60)
        return breaker_open()

    if not breaker_open():  # earlier tests' beats may have opened it already
        eventually(ticked_until_open, 120, "the nocmd pool's breaker to open")
    refused = pools.breakers()["nocmd"]
    assert refused.refused and refused.consecutive_failures >= 2
    assert refused.last_error is not None
    assert refused.last_error.startswith("template refused: local: command 'nosuchcmd-xyz' "
                                         "not found")
    assert not [lease for lease in pool_stack.runtime().store.leases()
                if lease.pool == "nocmd"]  # nothing recorded, nothing created

    shown = leasekeeper("pools", "--json", env=pool_stack.env)
    assert shown.returncode == 0, shown.stderr
    row = {r["pool"]: r for r in json.loads(shown.stdout)["pools"]}["nocmd"]
    assert row["breaker"] == "open" and row["template_refused"] is True
    assert row["failures_total"] >= 2 and "nosuchcmd-xyz" in row["last_error"]
    table = leasekeeper("pools", env=pool_stack.env).stdout
    line = next(x for x in table.splitlines() if x.startswith("nocmd"))
    assert "open until" in line and "template refused: local: command" in line, table

    status = leasekeeper("status", "--json", env=pool_stack.env)
    assert status.returncode == 1, status.stdout + status.stderr
    problems = [p for p in json.loads(status.stdout)["verdict"]["problems"] if "nocmd" in p]
    assert len(problems) == 1, problems
    assert problems[0].startswith("warm pool nocmd creates no member and every run asking "
                                  "it fails: template refused: local: command 'nosuchcmd-xyz'")
    assert "fix the pool's template in LEASEKEEPER_POOLS or LEASEKEEPER_POOLS_FILE" in \
        problems[0]
    text = leasekeeper("status", env=pool_stack.env).stdout
    assert "pool nocmd: 0 warm of 1 (max 1), 0 provisioning, 0 draining; breaker open; " \
        "template refused" in text, text
