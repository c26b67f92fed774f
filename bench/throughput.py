"""Lifecycle throughput against bare Celery, in one process, on one broker and worker.

For each store (SQLite, PostgreSQL): start Redis and a worker whose provider does no work
(``noop``), then time acquire+destroy pairs through the producer API against twice as
many no-op tasks (``leasekeeper.ping``) on the same broker and worker. The ratio says what
the lifecycle bookkeeping (validation, store transactions, events) costs. Prints JSON.

A shared machine's speed drifts within seconds, so each round alternates short chunks of
the two workloads (``--chunk`` pairs, then twice as many pings, then the other way round)
and compares their summed times: both see the same machine. The headline ``ratio`` is
the median of the rounds' ratios; ``cpu_ratio`` compares the CPU every process spent
(this one, the worker and its pool, Redis, PostgreSQL) per pair, bare over lifecycle, and
``cpu_ms_per_pair_by_role`` says which of them spends the difference.

    python bench/throughput.py [--pairs 400] [--chunk 200] [--rounds 5]
                               [--store sqlite|postgres|both] [--concurrency 2]
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=400, help="pairs per round")
    parser.add_argument("--chunk", type=int, default=200, help="pairs per chunk")
    parser.add_argument("--rounds", type=int, default=5)
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
            servers = {"redis": redis.proc.pid}
            if kind == "sqlite":
                url = f"sqlite:///{work / 'bench.db'}"
            else:
                postgres = postgres or start_postgres(work / "postgres")
                url = postgres.create_database(f"bench_{uuid.uuid4().hex[:8]}")
                servers["postgres"] = postgres.proc.pid
            results.append(bench_store(kind, url, work, args, servers))
    finally:
        if postgres:
            postgres.stop()
        redis.stop()
    print(json.dumps({"benchmark": "lifecycle_vs_bare_celery", "pairs_per_round": args.pairs,
                      "chunk": args.chunk, "rounds": args.rounds,
                      "worker_concurrency": args.concurrency, "results": results}, indent=2))


@dataclass
class Phase:
    """One workload's time and CPU in a round, summed over its chunks."""

    seconds: float = 0.0
    cpu_s: float = 0.0
    cpu_s_by_role: dict[str, float] = field(default_factory=dict)
    rates: list[float] = field(default_factory=list)


class CpuClock:
    """CPU seconds spent so far by each role's process tree (this process, the worker
    and its pool, each server), by role and in total."""

    def __init__(self, roles: dict[str, int]) -> None:
        import psutil

        self.roots = {role: psutil.Process(pid) for role, pid in roles.items()}

    def by_role(self) -> dict[str, float]:
        import psutil

        spent: dict[str, float] = {}
        for role, root in self.roots.items():
            spent[role] = 0.0
            children = [] if role == "producer" else root.children(recursive=True)
            for proc in [root, *children]:
                try:
                    times = proc.cpu_times()
                except psutil.Error:
                    continue
                spent[role] += times.user + times.system
        return spent

    def __call__(self) -> float:
        return sum(self.by_role().values())


def bench_store(kind: str, url: str, work: Path, args: argparse.Namespace,
                servers: dict[str, int]) -> dict[str, object]:
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
    worker = stack.start_worker(concurrency=args.concurrency)
    cpu = CpuClock({"producer": os.getpid(), "worker": worker.pid, **servers})

    def lifecycle(pairs: int) -> None:
        acquired = [producer.acquire_lease(f"b-{uuid.uuid4().hex[:12]}") for _ in range(pairs)]
        ids = [r.get(120)["lease_id"] for r in acquired]
        for r in [producer.destroy_lease(lease_id) for lease_id in ids]:
            r.get(120)

    def bare(pairs: int) -> None:
        for r in [app.send_task("leasekeeper.ping") for _ in range(2 * pairs)]:
            r.get(120)

    def timed(run: Callable[[int], None], phase: Phase, pairs: int) -> None:
        cpu0, started = cpu.by_role(), time.perf_counter()
        run(pairs)
        seconds = time.perf_counter() - started
        cpu1 = cpu.by_role()
        phase.seconds += seconds
        for role, spent in cpu1.items():
            phase.cpu_s_by_role[role] = phase.cpu_s_by_role.get(role, 0.0) + spent - cpu0[role]
        phase.cpu_s = sum(phase.cpu_s_by_role.values())
        phase.rates.append(pairs / seconds)

    try:
        for _ in range(2):  # warm both paths (connections, prepared statements, caches)
            lifecycle(args.chunk)
            bare(args.chunk)
        rounds: list[tuple[Phase, Phase]] = []
        for _ in range(args.rounds):
            life, base = Phase(), Phase()
            chunks = max(args.pairs // args.chunk, 1)
            for chunk in range(chunks):
                order = [(lifecycle, life), (bare, base)]
                for run, phase in order if chunk % 2 == 0 else reversed(order):
                    timed(run, phase, args.chunk)
            rounds.append((life, base))
    finally:
        stack.stop()
    pairs = max(args.pairs // args.chunk, 1) * args.chunk
    ratios = [base.seconds / life.seconds for life, base in rounds]
    cpu_ratios = [base.cpu_s / life.cpu_s for life, base in rounds]
    return {"store": kind,
            "lifecycle_pairs_per_s": round(statistics.median(
                pairs / life.seconds for life, _ in rounds), 1),
            "bare_celery_pairs_per_s": round(statistics.median(
                pairs / base.seconds for _, base in rounds), 1),
            "ratio": round(statistics.median(ratios), 3),
            "rounds_ratio": [round(x, 3) for x in ratios],
            "cpu_ratio": round(statistics.median(cpu_ratios), 3),
            "cpu_ms_per_pair": {
                "lifecycle": round(statistics.median(
                    life.cpu_s / pairs * 1000 for life, _ in rounds), 2),
                "bare": round(statistics.median(
                    base.cpu_s / pairs * 1000 for _, base in rounds), 2)},
            # where the difference is spent: each role's CPU per pair, lifecycle and bare
            "cpu_ms_per_pair_by_role": {
                role: {side: round(statistics.median(
                    r[i].cpu_s_by_role[role] / pairs * 1000 for r in rounds), 2)
                       for i, side in enumerate(("lifecycle", "bare"))}
                for role in rounds[0][0].cpu_s_by_role}}


if __name__ == "__main__":
    main()
