"""The lifecycle's task bodies with the caches a pool process gives them, against a ping's.

In a worker's pool process a task runs between Celery's, kombu's and redis-py's own work,
on a machine shared with Redis, the store and the producer, so its code and data are no
longer in the CPU's caches: in bench/throughput.py the bodies cost two to three times
what the same calls cost in a tight loop. This runs the tasks in one process, as the
worker's tracer calls them, with a step after each task that evicts the caches as that
work does (a sweep over 8 MiB, and a mix of the standard library's code), and counts only
the tasks' CPU. It reproduces what the pool processes spend (about 1.4 ms per
acquire+destroy pair on SQLite) with less noise than a worker, and says how much of it
the store's calls are: a change to the bodies can be tried here before bench/compare.py.
Prints JSON; ``ratio`` is a ping pair's CPU over a lifecycle pair's (with the PostgreSQL
server's, whose backends' caches the same machine's work also evicts). ``floor_us_per_pair``
(and ``floor_server_us_per_pair``) is what four durable transactions of one small insert
each cost on the same path, cold: the least a pair can cost in the store, since the
guarantees need four (the intent before the create, the activation, the destroy's claim
before the delete, its end).

    python bench/cold_bodies.py [--store sqlite|postgres] [--pairs 300] [--rounds 7]
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import pickle
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_BUFFER = bytearray(8 << 20)  # larger than a core's L2 cache
_BLOB = {"a": [list(range(50)), {"x": "y" * 100, "n": [1.5, None, True]}] * 20}
STORE_CALLS = ("start_run_with_intent", "move", "claim_to_destroy")


def pollute() -> None:
    """Other code and data between two tasks, as a worker's own work is."""
    for i in range(0, len(_BUFFER), 64):
        _BUFFER[i] = (_BUFFER[i] + 1) & 255
    pickle.loads(pickle.dumps(_BLOB))
    json.loads(json.dumps(_BLOB))
    email.parser.Parser().parsestr("From: a@b\nTo: c@d\nSubject: x\n\nbody\n")
    textwrap.wrap("lorem ipsum dolor sit amet " * 20, 40)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--pairs", type=int, default=300, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from tests.services import start_postgres

    work = Path(tempfile.mkdtemp(prefix="lk-cold-"))
    work.chmod(0o755)  # the postgres user must reach its data dir
    postgres = None
    try:
        if args.store == "sqlite":
            url = f"sqlite:///{work / 'bench.db'}"
        else:
            postgres = start_postgres(work / "postgres")
            url = postgres.create_database("bench")
        os.environ.update({"LEASEKEEPER_STORE_URL": url, "LEASEKEEPER_PROVIDER": "noop",
                           "LEASEKEEPER_PROVIDERS": "noop", "LEASEKEEPER_VAR_DIR": str(work)})
        result = bench(args, url, server_pid=postgres.proc.pid if postgres else None)
    finally:
        if postgres:
            postgres.stop()
    print(json.dumps({"benchmark": "cold_task_bodies", "store": args.store,
                      "pairs_per_round": args.pairs, "rounds": args.rounds, **result},
                     indent=2))


def bench(args: argparse.Namespace, url: str, server_pid: int | None) -> dict[str, Any]:
    from bench.throughput import CpuClock
    from models.migrate import upgrade
    from tasks.acquire import acquire
    from tasks.destroy import destroy
    from tasks.diag import ping

    upgrade(url)
    # the server and its backends (none with SQLite)
    server_cpu_s = CpuClock({"postgres": server_pid} if server_pid else {})

    def lifecycle(cold: bool) -> float:
        started = time.process_time()
        lease = acquire(run_id=f"b-{uuid.uuid4().hex[:12]}", spec={})
        between = time.process_time()
        if cold:
            pollute()
        resumed = time.process_time()
        destroy(lease_id=lease["lease_id"])
        spent = between - started + time.process_time() - resumed
        if cold:
            pollute()
        return spent

    def pings(cold: bool) -> float:
        spent = 0.0
        for _ in range(2):
            started = time.process_time()
            ping()
            spent += time.process_time() - started
            if cold:
                pollute()
        return spent

    def per_pair_us(pair: Callable[[bool], float], cold: bool) -> tuple[float, float]:
        """Median over the rounds of this process's and the server's CPU per pair."""
        rounds = []
        for _ in range(args.rounds):
            server0 = server_cpu_s()
            spent = sum(pair(cold) for _ in range(args.pairs))
            rounds.append((spent, server_cpu_s() - server0))
        return (statistics.median(r[0] for r in rounds) / args.pairs * 1e6,
                statistics.median(r[1] for r in rounds) / args.pairs * 1e6)

    floor_pair = four_writes()
    for _ in range(200):  # connections, prepared statements, the statement caches
        lifecycle(True)
        pings(True)
        floor_pair(True)
    found: dict[str, dict[str, float]] = {}
    for mode, cold in (("cold", True), ("warm", False)):
        life_us, server_us = per_pair_us(lifecycle, cold)
        ping_us, _ = per_pair_us(pings, cold)
        found[mode] = {"lifecycle_us_per_pair": round(life_us),
                       "ping_us_per_pair": round(ping_us),
                       "ratio": round(ping_us / (life_us + server_us), 3)}
        if server_pid is not None:  # the lifecycle's statements, on the server's side
            found[mode]["server_us_per_pair"] = round(server_us)
    # the least four durable transactions cost on this store, as the lifecycle's run
    floor_us, floor_server_us = per_pair_us(floor_pair, True)
    found["cold"]["floor_us_per_pair"] = round(floor_us)
    if server_pid is not None:
        found["cold"]["floor_server_us_per_pair"] = round(floor_server_us)
    with timed_store_calls() as spent_s:  # a pass of its own: the timing costs a little
        for _ in range(args.pairs):
            lifecycle(True)
    return {**found,
            "cold_over_warm": round(found["cold"]["lifecycle_us_per_pair"]
                                    / found["warm"]["lifecycle_us_per_pair"], 2),
            "store_calls_cold_us_per_pair": {
                name: round(spent_s[name] / args.pairs * 1e6) for name in STORE_CALLS}}


def four_writes() -> Callable[[bool], float]:
    """A pair's floor: the four transactions the guarantees need (the intent, the
    activation, the destroy's claim, its end), each one row inserted into a table with
    no index but its key, on the lifecycle's own connection and transaction path (the
    writers' lock, ``BEGIN IMMEDIATE`` and commit on SQLite; one statement in autocommit
    on PostgreSQL), with the caches evicted after every two, as after each task. What
    the lifecycle costs over this is its own work."""
    from sqlalchemy import text

    from workers.runtime import get_runtime

    store = get_runtime().store
    with store.engine.begin() as conn:
        key = "integer" if store.raw.dialect == "sqlite" else "bigserial"
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS bench_floor (id {key} PRIMARY KEY, "
                          "at text)"))
    insert = store.raw.sql("INSERT INTO bench_floor (at) VALUES (:at)")

    def pair(cold: bool) -> float:
        spent = 0.0
        for i in range(4):
            started = time.process_time()
            with store.raw_tx() as cur:
                cur.execute(insert, {"at": "x"})
            spent += time.process_time() - started
            if cold and i % 2:
                pollute()
        return spent

    return pair


@contextmanager
def timed_store_calls() -> Iterator[dict[str, float]]:
    """This process's CPU in each of the store calls a pair makes, while it lasts."""
    from models.store import Store

    spent_s = dict.fromkeys(STORE_CALLS, 0.0)
    originals = {name: getattr(Store, name) for name in STORE_CALLS}

    def timing(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return call(*args, **kwargs)
            finally:
                spent_s[name] += time.process_time() - started
        return timed

    for name, call in originals.items():
        setattr(Store, name, timing(name, call))
    try:
        yield spent_s
    finally:
        for name, call in originals.items():
            setattr(Store, name, call)


if __name__ == "__main__":
    main()
