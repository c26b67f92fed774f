"""The console's pages and the exporter's scrape on a big store (default a million leases,
SQLite): medians of each read the console and the exporter make, against the baseline of
one lease read by primary key. Prints JSON.

    python bench/observe_queries.py [--leases 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def fill(store: Any, n: int) -> list[str]:
    """n leases (1% active, 0.1% pending_cleanup, 0.01% abandoned, the rest destroyed) over
    200 tenants and 2 providers, each with two events, ids time-ordered like real ones;
    generated inside SQLite (a recursive CTE), which is what makes a million quick."""
    from sqlalchemy import text

    state = ("CASE WHEN i % 10000 = 7 THEN 'abandoned' WHEN i % 1000 = 3 THEN "
             "'pending_cleanup' WHEN i % 100 = 1 THEN 'active' ELSE 'destroyed' END")
    lease_id = "printf('%012x%020x', 1700000000000 + i * 2500, i)"
    created = "datetime('now', '-30 days', '+' || (i * 2.5) || ' seconds')"
    series = "WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i < :last)"
    with store.tx() as s:
        s.execute(text(
            f"{series} INSERT INTO leases (lease_id, sandbox_key, live_key, provider, "
            "provider_lease_id, backend, provider_meta, state, reuse, tenant, thread_id, run_id,"
            " spec, created_at, updated_at, ready_at, acquire_deadline_at, deadline_at, "
            "idle_timeout_s, cleanup_attempts, version) "
            f"SELECT {lease_id}, 'sk-' || {lease_id}, CASE WHEN {state} = 'active' THEN 'sk-' "
            f"|| {lease_id} END, CASE WHEN i % 2 THEN 'kubernetes' ELSE 'local' END, "
            f"'lk-' || {lease_id}, 'job', '{{}}', {state}, 0, 'tenant-' || (i % 200), NULL, "
            f"'run-' || i, '{{}}', {created}, {created}, {created}, {created}, {created}, 60, "
            "0, 1 FROM c"), {"last": n - 1})
        for to_state in ("'provisioning'", f"CASE WHEN {state} = 'pending_cleanup' THEN "
                         "'pending_cleanup' ELSE 'active' END"):
            s.execute(text(
                f"{series} INSERT INTO lease_events (lease_id, at, from_state, to_state, "
                f"reason) SELECT {lease_id}, {created}, NULL, {to_state}, 'bench' FROM c"),
                {"last": n - 1})
    return [f"{1700000000000 + i * 2500:012x}{i:020x}" for i in range(n)]


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leases", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from models.migrate import upgrade
    from models.observe import LeaseFilter, Observe
    from models.store import Store

    url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='lk-bench-observe-')) / 'store.db'}"
    upgrade(url)
    store = Store(url)
    t0 = time.perf_counter()
    ids = fill(store, args.leases)
    fill_s = time.perf_counter() - t0
    observe = Observe(store)
    middle = ids[len(ids) // 2]
    reads: dict[str, Callable[[], object]] = {
        "lease_by_id (baseline)": lambda: store.get_lease(middle),
        "lease_page newest 51": lambda: observe.lease_page(LeaseFilter(), None, 51),
        "lease_page deep keyset 51": lambda: observe.lease_page(LeaseFilter(), middle, 51),
        "lease_page state=abandoned": lambda: observe.lease_page(
            LeaseFilter(state="abandoned"), None, 51),
        "lease_page tenant": lambda: observe.lease_page(LeaseFilter(tenant="tenant-7"), None,
                                                        51),
        "lease_page state+tenant+provider": lambda: observe.lease_page(
            LeaseFilter(state="active", tenant="tenant-7", provider="kubernetes"), None, 51),
        "lease history": lambda: store.events(middle),
        "console counts_by_state": observe.counts_by_state,
        "console destroyed count (cached 60 s)": lambda: observe.counts_by_state(
            ["destroyed"]),
        "exporter lease_counts": observe.lease_counts,
        "exporter oldest_cleanup_wait": observe.oldest_cleanup_wait_since,
        "exporter run_counts": observe.run_counts,
        "exporter events tail 5000": lambda: observe.events_from(len(ids), 5000),
    }
    for fn in reads.values():  # warm the page cache once
        fn()
    medians = {name: median_ms(fn, args.rounds) for name, fn in reads.items()}
    baseline = medians["lease_by_id (baseline)"]
    results = {name: {"median_ms": ms, "vs_baseline": round(ms / baseline, 1)}
               for name, ms in medians.items()}
    print(json.dumps({"store": "sqlite", "leases": args.leases, "fill_s": round(fill_s, 1),
                      "baseline_ms": baseline, "reads": results}, indent=2))
    store.dispose()


if __name__ == "__main__":
    main()
