"""Lifecycle throughput against bare Celery, in one process, on one broker and worker.

For each store (SQLite, PostgreSQL): start Redis and a worker whose provider does no work
(``noop``), then time N acquire+destroy pairs through the producer API against 2N no-op
tasks (``leasekeeper.ping``) on the same broker and worker. The ratio says what the
lifecycle bookkeeping (validation, store transactions, events) costs. Prints JSON.

    python bench/throughput.py [--pairs 200] [--rounds 3] [--store sqlite|postgres|both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    from tests.services import free_port, start_postgres, start_redis

    work = Path(tempfile.mkdtemp(prefix="lk-bench-"))
    work.chmod(0o755)
    redis_port = free_port()
    os.environ["LEASEKEEPER_BROKER_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ["LEASEKEEPER_PROVIDERS"] = "noop,local"
    os.environ["LEASEKEEPER_PROVIDER"] = "noop"
    redis = start_redis(work / "redis", redis_port)
    postgres = None
    results = []
    try:
        stores = ["sqlite", "postgres"] if args.store == "both" else [args.store]
        for kind in stores:
            if kind == "sqlite":
                url = f"sqlite:///{work / 'bench.db'}"
            else:
                postgres = postgres or start_postgres(work / "postgres")
                url = postgres.create_database(f"bench_{uuid.uuid4().hex[:8]}")
            results.append(bench_store(kind, url, work, args.pairs, args.rounds,
                                       args.concurrency))
    finally:
        if postgres:
            postgres.stop()
        redis.stop()
    print(json.dumps({"benchmark": "lifecycle_vs_bare_celery", "pairs": args.pairs,
                      "rounds": args.rounds, "worker_concurrency": args.concurrency,
                      "results": results}, indent=2))


def bench_store(kind: str, url: str, work: Path, pairs: int, rounds: int,
                concurrency: int) -> dict[str, object]:
    import redis as redis_lib

    from models.migrate import upgrade
    from tasks import producer
    from tests.stack import WorkerStack
    from workers.app import app

    upgrade(url)
    redis_lib.Redis.from_url(os.environ["LEASEKEEPER_BROKER_URL"]).flushdb()
    stack = WorkerStack(name=f"bench-{kind}", store_url=url, root=work / kind,
                        broker_url=os.environ["LEASEKEEPER_BROKER_URL"],
                        extra_env={"LEASEKEEPER_PROVIDER": "noop",
                                   "LEASEKEEPER_PROVIDERS": "noop,local"})
    stack.root.mkdir(parents=True, exist_ok=True)
    os.environ["LEASEKEEPER_STORE_URL"] = url
    stack.start_worker(concurrency=concurrency)
    try:
        warm = [producer.acquire_lease(f"warm-{i}-{uuid.uuid4().hex[:6]}") for i in range(10)]
        for r in warm:
            r.get(60)
        lifecycle, bare = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            acquired = [producer.acquire_lease(f"b-{uuid.uuid4().hex[:12]}")
                        for _ in range(pairs)]
            ids = [r.get(120)["lease_id"] for r in acquired]
            for r in [producer.destroy_lease(lease_id) for lease_id in ids]:
                r.get(120)
            lifecycle.append(pairs / (time.perf_counter() - started))

            started = time.perf_counter()
            for r in [app.send_task("leasekeeper.ping") for _ in range(2 * pairs)]:
                r.get(120)
            bare.append(pairs / (time.perf_counter() - started))
    finally:
        stack.stop()
    lifecycle_rate, bare_rate = statistics.median(lifecycle), statistics.median(bare)
    # Each round pairs a lifecycle run with the bare run right after it, so the per-round
    # ratio cancels most of a shared machine's noise; its median is the headline figure.
    ratios = [life / b for life, b in zip(lifecycle, bare, strict=True)]
    return {"store": kind, "lifecycle_pairs_per_s": round(lifecycle_rate, 1),
            "bare_celery_pairs_per_s": round(bare_rate, 1),
            "ratio": round(statistics.median(ratios), 3),
            "rounds_ratio": [round(x, 3) for x in ratios],
            "rounds_lifecycle": [round(x, 1) for x in lifecycle],
            "rounds_bare": [round(x, 1) for x in bare]}


if __name__ == "__main__":
    main()
