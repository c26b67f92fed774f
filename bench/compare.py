"""Lifecycle throughput of two checkouts, interleaved on one machine state. Prints JSON.

bench/throughput.py compares the lifecycle with bare Celery inside one run; two runs of it
(before and after a change) see a shared machine in different moods, and their ratios
differ by more than most changes. This runs both checkouts at once: each gets its own
Redis, store and worker (2 pool processes, ``noop`` provider, from its own code), and
every round times a chunk of acquire+destroy pairs and a chunk of twice as many pings on
each, in an order reversed every other round, so drift hits both alike. Tasks are sent by
name with their JSON payloads, the same for both. ``b_over_a`` is the median of the
rounds' B ratio over A ratio.

    python bench/compare.py A_CHECKOUT B_CHECKOUT [--store sqlite|postgres]
                            [--rounds 24] [--chunk 200]

e.g. ``git worktree add /tmp/base HEAD~3 && python bench/compare.py /tmp/base .``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.throughput import CpuClock  # noqa: E402
from tests.services import (  # noqa: E402
    PostgresServer,
    RedisServer,
    free_port,
    start_postgres,
    start_redis,
)


class Side:
    """One checkout's Redis, store and worker, and a Celery client for them."""

    def __init__(self, name: str, checkout: Path, work: Path, store: str,
                 postgres: PostgresServer | None) -> None:
        from celery import Celery

        self.name, self.checkout = name, checkout
        self.root = work / name
        self.root.mkdir(parents=True)
        self.worker: subprocess.Popen[bytes] | None = None
        self.redis: RedisServer = start_redis(self.root / "redis", free_port())
        broker = f"redis://127.0.0.1:{self.redis.port}/0"
        if postgres is None:
            url = f"sqlite:///{self.root / 'store.db'}"
        else:
            url = postgres.create_database(f"compare_{name.lower()}_{uuid.uuid4().hex[:6]}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        env.update({"PYTHONPATH": str(checkout), "LEASEKEEPER_BROKER_URL": broker,
                    "LEASEKEEPER_STORE_URL": url, "LEASEKEEPER_VAR_DIR": str(self.root),
                    "LEASEKEEPER_PROVIDERS": "noop,local", "LEASEKEEPER_PROVIDER": "noop",
                    "LEASEKEEPER_LOCAL_ROOT_DIR": str(self.root / "sandboxes")})
        subprocess.run([sys.executable, "-c",
                        f"from models.migrate import upgrade; upgrade({url!r})"],
                       cwd=checkout, env=env, check=True)
        with open(self.root / "worker.log", "ab") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P",
                 "prefork", "-c", "2", "-E", "-n", f"compare-{name}@bench",
                 "--without-gossip", "--without-mingle", "-l", "info"],
                cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.app = Celery(f"compare-{name}", broker=broker, backend=broker,
                          set_as_current=False)
        self.app.conf.update(task_serializer="json", result_serializer="json",
                             accept_content=["json"], result_accept_content=["json"])
        deadline = time.monotonic() + 120
        while not self.app.control.ping(destination=[f"compare-{name}@bench"], timeout=0.5):
            if time.monotonic() > deadline or self.worker.poll() is not None:
                raise RuntimeError(f"worker {name} did not start: see {self.root}/worker.log")

    def pids(self) -> list[int]:
        assert self.worker is not None
        return [self.worker.pid, self.redis.proc.pid]

    def lifecycle(self, pairs: int) -> None:
        send = self.app.send_task
        acquired = [send("lease.acquire", kwargs={"run_id": f"b-{uuid.uuid4().hex[:12]}",
                                                  "spec": {}}) for _ in range(pairs)]
        ids = [r.get(120)["lease_id"] for r in acquired]
        for r in [send("lease.destroy", kwargs={"lease_id": i}) for i in ids]:
            r.get(120)

    def bare(self, pairs: int) -> None:
        for r in [self.app.send_task("leasekeeper.ping") for _ in range(2 * pairs)]:
            r.get(120)

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(5)
        self.redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=200)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # finally: below still runs

    work = Path(tempfile.mkdtemp(prefix="lk-compare-"))
    work.chmod(0o755)
    postgres = start_postgres(work / "postgres") if args.store == "postgres" else None
    sides: list[Side] = []
    try:
        for name, checkout in (("A", args.a.resolve()), ("B", args.b.resolve())):
            sides.append(Side(name, checkout, work, args.store, postgres))
        print(json.dumps(compare(sides, args.rounds, args.chunk, postgres), indent=2))
    finally:
        for side in sides:
            side.stop()
        if postgres is not None:
            postgres.stop()


def compare(sides: list[Side], rounds: int, chunk: int,
            postgres: PostgresServer | None) -> dict[str, Any]:
    for side in sides:  # warm both paths on both
        side.lifecycle(chunk // 4)
        side.bare(chunk // 4)
    servers = {"postgres": postgres.proc.pid} if postgres is not None else {}
    seconds: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    cpu_s: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    for number in range(rounds):
        steps = [(side, kind) for side in sides for kind in ("lifecycle", "bare")]
        if number % 2:
            steps.reverse()
        took: dict[str, dict[str, float]] = {s.name: {} for s in sides}
        spent: dict[str, dict[str, float]] = {s.name: {} for s in sides}
        for side, kind in steps:
            clock = CpuClock({"producer": os.getpid(), **servers,
                              **{f"side{n}": pid for n, pid in enumerate(side.pids())}})
            cpu0, started = clock(), time.perf_counter()
            getattr(side, kind)(chunk)
            took[side.name][kind] = time.perf_counter() - started
            spent[side.name][kind] = clock() - cpu0
        for side in sides:
            seconds[side.name].append(took[side.name])
            cpu_s[side.name].append(spent[side.name])

    def ratios(name: str, of: dict[str, list[dict[str, float]]]) -> list[float]:
        return [r["bare"] / r["lifecycle"] for r in of[name]]

    result: dict[str, Any] = {"benchmark": "lifecycle_vs_bare_celery_a_b", "rounds": rounds,
                              "chunk": chunk}
    for side in sides:
        result[side.name] = {
            "checkout": str(side.checkout),
            "ratio": round(statistics.median(ratios(side.name, seconds)), 3),
            "cpu_ratio": round(statistics.median(ratios(side.name, cpu_s)), 3),
            "cpu_ms_per_pair": {kind: round(statistics.median(
                r[kind] / chunk * 1000 for r in cpu_s[side.name]), 2)
                for kind in ("lifecycle", "bare")}}
    result["b_over_a"] = round(statistics.median(
        b / a for a, b in zip(ratios("A", seconds), ratios("B", seconds), strict=True)), 3)
    return result


if __name__ == "__main__":
    main()
