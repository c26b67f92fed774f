"""Scale-out: lifecycle throughput with 1 and with 2 worker processes on one PostgreSQL and
one Redis, and the CPU each part spends per acquire+destroy pair.

Each worker is a separate ``celery worker`` process (prefork, ``-c 2``) on the ``noop``
provider; all share the broker and the store, as workers on several hosts would. Per
configuration: pairs/s (median of rounds) and CPU seconds per pair of the workers (main
and pool processes), PostgreSQL (every server process) and Redis. ``store_bound_pairs_per_s``
= 1 / PostgreSQL CPU per pair: the rate at which one PostgreSQL core is saturated, i.e.
where adding workers stops helping unless the store has more cores. JSON.

    python bench/scaleout.py [--pairs 300] [--rounds 3] [--store postgres|sqlite]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from workload import Services, cpu_by_pid, cpu_since, noop_stack, pairs, services


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    with services() as svc:
        results = [measure(svc, args.store, workers, args.pairs, args.rounds, args.concurrency)
                   for workers in (1, 2)]
    one, two = results
    print(json.dumps({"benchmark": "scale_out_workers", "store": args.store,
                      "pairs": args.pairs, "rounds": args.rounds,
                      "cpus_on_this_machine": os.cpu_count(),
                      "load_average_1m": round(os.getloadavg()[0], 1),
                      "ratio": round(float(two["pairs_per_s"]) / float(one["pairs_per_s"]), 2),
                      "results": results}, indent=2))


def measure(svc: Services, store: str, workers: int, count: int, rounds: int,
            concurrency: int) -> dict[str, object]:
    with noop_stack(svc, svc.store_url(store), f"scale-{workers}") as stack:
        procs = [stack.start_worker(concurrency=concurrency)  # type: ignore[attr-defined]
                 for _ in range(workers)]
        pairs(20, "warm")
        worker_pids = [p.pid for p in procs]
        pg_pids = [svc.postgres.proc.pid] if svc.postgres else []
        redis_pids = [svc.redis.proc.pid]
        rates, cpu = [], {"workers": 0.0, "postgres": 0.0, "redis": 0.0}
        for _ in range(rounds):
            before = {"workers": cpu_by_pid(worker_pids), "postgres": cpu_by_pid(pg_pids),
                      "redis": cpu_by_pid(redis_pids)}
            started = time.perf_counter()
            pairs(count, "s")
            rates.append(count / (time.perf_counter() - started))
            cpu["workers"] += cpu_since(before["workers"], worker_pids)
            cpu["postgres"] += cpu_since(before["postgres"], pg_pids)
            cpu["redis"] += cpu_since(before["redis"], redis_pids)
    per_pair = {part: round(used / (count * rounds) * 1000, 2) for part, used in cpu.items()}
    result: dict[str, object] = {
        "worker_processes": workers, "pool_processes_each": concurrency,
        "pairs_per_s": round(statistics.median(rates), 1),
        "rounds_pairs_per_s": [round(r, 1) for r in rates],
        "cpu_ms_per_pair": per_pair}
    if store == "postgres" and per_pair["postgres"] > 0:
        result["store_bound_pairs_per_s"] = round(1000 / per_pair["postgres"], 0)
    return result


if __name__ == "__main__":
    main()
