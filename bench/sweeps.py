"""Sweeps and listings stay flat as history grows: each sweep's read-and-claim and a lease
listing page, at 10k and at 1M rows of realistic history, on PostgreSQL.

The history (tests/store/history.py): 98% destroyed leases with completed, reclaimed runs,
1% active, the rest provisioning, pending_cleanup, destroying and abandoned; about 30 rows
due per sweep at any size (the sweeps keep up). Each unit is timed as a tick runs it (the
due read, then the claim of what it read, through the real SweepStore), inside a
transaction rolled back after each repetition, so every repetition sees the same rows.
The exporter's reads at each scrape are timed too (``scrape.*``).
Listings are keyset pages (newest first; a page at mid history; filtered by state).
``ratio`` = the worst (1M median / 10k median) over all units; goal <= 1.5. JSON.

    python bench/sweeps.py [--sizes 10000,1000000] [--repeat 25] [--schema-revision 0001]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.migrate import upgrade
from models.store import Store
from models.sweep_store import SweepStore
from tests.services import PostgresServer, start_postgres
from tests.store.history import (
    SWEEP_READS_AND_CLAIMS,
    RolledBackStore,
    listings,
    load_history,
    scrape_reads,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--schema-revision", default="head",
                        help="migrate only this far (0001: the indexes before 0002_perf12)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lk-bench-sweeps-"))
    work.chmod(0o755)
    postgres = start_postgres(work / "postgres")
    try:
        result = run(postgres, sizes, args.repeat, args.schema_revision)
    finally:
        postgres.stop()
    print(json.dumps({"benchmark": "sweeps_and_listings_vs_history_size", "sizes": sizes,
                      "repeat": args.repeat, "schema_revision": args.schema_revision,
                      **result}, indent=2))


def load(postgres: PostgresServer, rows: int, revision: str) -> tuple[str, float]:
    url = postgres.create_database(f"sweeps_{rows}_{uuid.uuid4().hex[:6]}")
    upgrade(url, revision)
    store = Store(url, statement_timeout_s=3600.0)  # a bulk load, not a lifecycle statement
    started = time.perf_counter()
    try:
        load_history(store.engine, rows)
    finally:
        store.dispose()
    return url, round(time.perf_counter() - started, 1)


def run(postgres: PostgresServer, sizes: list[int], repeat: int, revision: str
        ) -> dict[str, object]:
    """Load every size first, then time each unit on every size in turn, repetition by
    repetition, so a loaded machine's drift hits all sizes alike."""
    loaded = {rows: load(postgres, rows, revision) for rows in sizes}
    stores = {rows: Store(url) for rows, (url, _) in loaded.items()}
    samples: dict[str, dict[int, list[float]]] = {}
    try:
        with contextlib.ExitStack() as stack:
            conns = {rows: stack.enter_context(store.engine.connect())
                     for rows, store in stores.items()}
            rolled_back = {rows: RolledBackStore(loaded[rows][0], conn)
                           for rows, conn in conns.items()}
            for name in units(sizes[0]):
                samples[name] = {rows: [] for rows in sizes}
                for _ in range(repeat + 3):  # the first three warm the caches
                    for rows in sizes:
                        call = units(rows)[name]
                        outer = conns[rows].begin()
                        begun = time.perf_counter()
                        call(rolled_back[rows])
                        samples[name][rows].append(time.perf_counter() - begun)
                        outer.rollback()
    finally:
        for store in stores.values():
            store.dispose()
    table: dict[str, dict[str, float]] = {}
    for name, by_rows in samples.items():
        medians = {rows: statistics.median(times[3:]) * 1000 for rows, times in by_rows.items()}
        table[name] = {f"{rows}_ms": round(ms, 3) for rows, ms in medians.items()}
        table[name]["ratio"] = round(medians[sizes[-1]] / medians[sizes[0]], 2)
    worst = max(table, key=lambda name: table[name]["ratio"])
    return {"ratio": table[worst]["ratio"], "worst": worst,
            "load_s": {rows: loaded[rows][1] for rows in sizes}, "units": table}


def units(rows: int) -> dict[str, Callable[[Store], object]]:
    calls: dict[str, Callable[[Store], object]] = {
        name: (lambda st, call=call: call(SweepStore(st)))
        for name, call in SWEEP_READS_AND_CLAIMS.items()}
    calls.update(listings(rows))
    calls.update({f"scrape.{name}": call for name, call in scrape_reads(rows).items()})
    return calls


if __name__ == "__main__":
    main()
