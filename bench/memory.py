"""Worker memory: RSS of a worker's main process and of each pool process after N tasks.

A real worker (prefork, ``-c 2``) on the ``noop`` provider runs acquire+destroy pairs
through the producer API in chunks; after the warm-up and after every chunk the RSS of the
main process and of every pool process is sampled. Goal: every process <= 150 MB, and no
growth from chunk to chunk beyond noise. JSON, one result per store.

    python bench/memory.py [--store sqlite|postgres|both] [--pairs 3000] [--chunks 6]
"""

from __future__ import annotations

import argparse
import json

from workload import Services, noop_stack, pairs, rss_mb, services, tree

LIMIT_MB = 150.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--chunks", type=int, default=6)
    args = parser.parse_args()
    stores = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    with services() as svc:
        results = [measure(svc, kind, args.pairs, args.chunks) for kind in stores]
    print(json.dumps({"benchmark": "worker_memory", "limit_mb": LIMIT_MB,
                      "tasks_per_store": 2 * args.pairs,
                      "within_limit": all(r["within_limit"] for r in results),
                      "results": results}, indent=2))


def measure(svc: Services, kind: str, count: int, chunks: int) -> dict[str, object]:
    with noop_stack(svc, svc.store_url(kind), f"memory-{kind}") as stack:
        worker = stack.start_worker(concurrency=2)  # type: ignore[attr-defined]
        pairs(20, "warm")

        def sample() -> dict[str, object]:
            main, *children = tree(worker.pid)
            return {"main_mb": rss_mb(main), "children_mb": [rss_mb(c) for c in children]}

        samples = [{"tasks": 40, **sample()}]
        per_chunk = max(count // chunks, 1)
        for chunk in range(chunks):
            pairs(per_chunk, f"m{chunk}")
            samples.append({"tasks": 40 + 2 * per_chunk * (chunk + 1), **sample()})
    peak = max(max([s["main_mb"], *s["children_mb"]]) for s in samples)  # type: ignore[list-item]
    first, last = samples[1], samples[-1]
    return {"store": kind, "peak_process_mb": peak, "within_limit": peak <= LIMIT_MB,
            "main_growth_mb_after_first_chunk": round(
                float(last["main_mb"]) - float(first["main_mb"]), 1),  # type: ignore[arg-type]
            "children_growth_mb_after_first_chunk": round(
                max(last["children_mb"]) - max(first["children_mb"]), 1),  # type: ignore[arg-type]
            "samples": samples}


if __name__ == "__main__":
    main()
