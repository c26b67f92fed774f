"""Warm pools through a real worker: claim latency, and a burst of claims against refill.

Latency (producer call → result returned, one at a time, the worker otherwise idle): a
warm claim (``spec.pool``) against a cold acquire of the same sandbox and against a bare
Celery round trip (``leasekeeper.ping``), the three one after the other in every sample so
a shared machine's noise hits them alike. Before each sample the pool is refilled (a
``sweep.fill_pools`` sent by hand) and the worker is idle again (no task active), so every
claim finds a warm member; every lease is destroyed after its sample (not timed).
Targets: claim p50 <= 50 ms and <= 2x the bare round trip.

Burst: ``--burst`` claims sent at once at a pool of ``--burst-size`` (max_size 20% above),
with celery beat filling every second: the hit rate, the time until the pool is full again
(from the first send), and the most unclaimed members the store held at any instant
(sampled every 5 ms; must be <= max_size).

A provider is a setup (``SETUPS``): the worker's settings for it and the pool template. A
``kubernetes`` setup (a cluster from tests/cluster, its settings) can be added beside
``local`` without touching the rest. Prints JSON.

    python bench/pools.py [--provider local] [--store sqlite|postgres] [--samples 60]
                          [--burst 50] [--burst-size 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from workload import WORK, Services, services

LATENCY_POOL, BURST_POOL = "bench", "burst"


@dataclass
class ProviderSetup:
    """How to run the bench on one provider: the worker's extra settings, the pools'
    template, and anything to stop afterwards."""

    name: str
    env: dict[str, str]
    template: dict[str, Any] = field(default_factory=dict)
    stop: Callable[[], None] = lambda: None


def local_setup(_svc: Services) -> ProviderSetup:
    return ProviderSetup("local", {"LEASEKEEPER_PROVIDERS": "local",
                                   "LEASEKEEPER_PROVIDER": "local"})


# --provider kubernetes: a setup starting tests/cluster's API server (and its simulators)
# and returning its LEASEKEEPER_KUBE_* settings goes here.
SETUPS: dict[str, Callable[[Services], ProviderSetup]] = {"local": local_setup}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=sorted(SETUPS), default="local")
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--burst-size", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    with services() as svc:
        setup = SETUPS[args.provider](svc)
        try:
            result = run(svc, setup, args)
        finally:
            setup.stop()
    print(json.dumps(result, indent=2))


def run(svc: Services, setup: ProviderSetup, args: argparse.Namespace) -> dict[str, Any]:
    burst_max = args.burst_size + max(1, args.burst_size // 5)
    pools = [{"name": LATENCY_POOL, "provider": setup.name, "size": 2, "max_size": 2,
              "template": setup.template},
             {"name": BURST_POOL, "provider": setup.name, "size": args.burst_size,
              "max_size": burst_max, "fill_batch_size": burst_max,
              "template": setup.template}]
    with pool_stack(svc, setup, args.store, pools, args.concurrency) as stack:
        latency = measure_latency(stack, setup, args.samples)
        burst = measure_burst(stack, args.burst, args.burst_size, burst_max)
    return {"benchmark": "warm_pool_claims", "provider": setup.name, "store": args.store,
            "worker_concurrency": args.concurrency, **latency, "burst": burst}


@contextlib.contextmanager
def pool_stack(svc: Services, setup: ProviderSetup, store: str, pools: list[dict[str, Any]],
               concurrency: int) -> Iterator[Any]:
    import os

    from tests.stack import WorkerStack

    name = f"pools-{uuid.uuid4().hex[:6]}"
    url = svc.store_url(store)
    stack = WorkerStack(name=name, store_url=url, root=WORK / name, broker_url=svc.broker_url,
                        extra_env={**setup.env, "LEASEKEEPER_POOLS": json.dumps(pools),
                                   # every sweep but the fill, out of the way
                                   **{f"LEASEKEEPER_{s}_INTERVAL_S": "3600" for s in (
                                       "REAP_RUNS", "EXPIRE_LEASES", "RETRY_CLEANUP",
                                       "FINISH_EXITED", "STUCK_PROVISIONING", "ORPHANS")}})
    stack.root.mkdir(parents=True, exist_ok=True)
    os.environ["LEASEKEEPER_STORE_URL"] = url
    stack.start_worker(concurrency=concurrency)
    try:
        yield stack
    finally:
        stack.stop()
        from tests.pools.conftest import destroy_everything

        with contextlib.suppress(Exception):
            destroy_everything(stack.runtime())


def counts(stack: Any, pool: str) -> dict[str, int]:
    from models.pool_store import PoolStore

    found: dict[str, int] = PoolStore(stack.runtime().store).member_counts([pool])[pool]
    return found


def wait_until(probe: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``probe()`` held (a monotonic deadline; polled every 5 ms)."""
    started = time.monotonic()
    while not probe():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - started


def measure_latency(stack: Any, setup: ProviderSetup, samples: int) -> dict[str, Any]:
    from tasks import producer
    from workers.app import app

    def timed(send: Callable[[], Any]) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        reply = send().get(120)
        return time.perf_counter() - started, reply

    hostname = stack.hostname(1)

    def idle() -> bool:
        active = app.control.inspect(destination=[hostname], timeout=1).active() or {}
        return hostname in active and not active[hostname]

    def refill() -> None:
        """The pool full and the worker idle again (its pool.provision tasks finished)."""
        app.send_task("sweep.fill_pools").get(60)
        wait_until(lambda: counts(stack, LATENCY_POOL)["warm"] == 2, 60, "the pool refilled")
        wait_until(idle, 60, "the worker idle")

    cold_spec = {"provider": setup.name, **setup.template}
    claim_s, cold_s, bare_s, results = [], [], [], []
    for i in range(samples + 3):  # the first three warm the worker's processes up
        refill()
        took, _ = timed(lambda: app.send_task("leasekeeper.ping"))
        claim_took, claimed = timed(lambda: producer.acquire_lease(
            f"claim-{uuid.uuid4().hex[:10]}", {"pool": LATENCY_POOL}))
        cold_took, cold = timed(lambda: producer.acquire_lease(
            f"cold-{uuid.uuid4().hex[:10]}", cold_spec))
        for reply in (claimed, cold):
            producer.destroy_lease(reply["lease_id"]).get(120)
        if i >= 3:
            bare_s.append(took)
            claim_s.append(claim_took)
            cold_s.append(cold_took)
            results.append(claimed["result"])
    claim, cold, bare = stats(claim_s), stats(cold_s), stats(bare_s)
    return {"samples": samples, "claim_results": {r: results.count(r) for r in set(results)},
            "claim_ms": claim, "cold_acquire_ms": cold, "bare_celery_ms": bare,
            "claim_vs_bare_p50": round(claim["p50"] / bare["p50"], 2),
            "claim_vs_cold_p50": round(claim["p50"] / cold["p50"], 3),
            "targets": {"claim_p50_le_50_ms": claim["p50"] <= 50,
                        "claim_p50_le_2x_bare": claim["p50"] <= 2 * bare["p50"]}}


def stats(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1000, 1), "p99": round(p99 * 1000, 1),
            "min": round(ordered[0] * 1000, 1)}


def measure_burst(stack: Any, claims: int, size: int, max_size: int) -> dict[str, Any]:
    from tasks import producer
    from tests.sweeps.beats import beats

    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sum(counts(stack, BURST_POOL).values()))
            time.sleep(0.005)

    with beats(stack.env, stack.root, 1, interval_s=1.0, tag="burst"):
        wait_until(lambda: counts(stack, BURST_POOL)["warm"] == size, 120, "the pool filled")
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            started = time.monotonic()
            sent = [producer.acquire_lease(f"burst-{uuid.uuid4().hex[:10]}",
                                           {"pool": BURST_POOL}) for _ in range(claims)]
            replies = [r.get(300) for r in sent]
            served_s = time.monotonic() - started
            wait_until(lambda: counts(stack, BURST_POOL)["warm"] == size, 300,
                       "the pool refilled")
            refill_s = time.monotonic() - started
        finally:
            stop.set()
            sampler.join(30)
    for reply in replies:
        producer.destroy_lease(reply["lease_id"]).get(120)
    hits = sum(1 for r in replies if r["result"] == "claimed")
    return {"claims": claims, "pool_size": size, "max_size": max_size, "claimed": hits,
            "hit_rate": round(hits / claims, 3), "all_served_s": round(served_s, 2),
            "refilled_s": round(refill_s, 2), "max_members_observed": max(seen),
            "samples_of_members": len(seen), "within_max_size": max(seen) <= max_size}


if __name__ == "__main__":
    main()
