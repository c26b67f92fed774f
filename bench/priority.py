"""Cleanup is never starved: destroy latency while 2,000 acquires are queued, against idle.

One worker on the default settings (every lane, cleanup polled first), the ``noop``
provider. Each sample sends one ``lease.destroy`` and waits for its result. Idle: nothing
else queued. Busy: after 2,000 acquires were sent, while they are still queued (the
acquire queue's length is recorded at every busy sample; the run is invalid if it emptied).
``ratio`` = busy p50 / idle p50 (goal <= 2). ``--cleanup-worker`` adds a dedicated
``-Q <base>.cleanup`` worker (the production recommendation) and measures that too. JSON.

    python bench/priority.py [--store sqlite|postgres] [--samples 30] [--backlog 2000]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from workload import NOOP_ENV, Services, noop_stack, p50_ms, services


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--cleanup-worker", action="store_true")
    args = parser.parse_args()
    results = []
    with services() as svc:
        setups = [False, True] if args.cleanup_worker else [False]
        for dedicated in setups:
            results.append(measure(svc, args.store, args.samples, args.backlog,
                                   args.concurrency, dedicated))
    print(json.dumps({"benchmark": "destroy_latency_under_acquire_backlog",
                      "store": args.store, "provider": NOOP_ENV["LEASEKEEPER_PROVIDER"],
                      "backlog_acquires": args.backlog, "samples": args.samples,
                      "ratio": results[0]["ratio"], "results": results}, indent=2))


def measure(svc: Services, store: str, samples: int, backlog: int, concurrency: int,
            dedicated: bool) -> dict[str, object]:
    import redis as redis_lib

    from tasks import producer
    from workers.app import app
    from workers.queues import Lane, queue_name

    base = str(app.conf.task_default_queue)
    acquire_q, cleanup_q = queue_name(base, Lane.ACQUIRE), queue_name(base, Lane.CLEANUP)
    broker = redis_lib.Redis.from_url(svc.broker_url)
    name = "priority-dedicated" if dedicated else "priority"
    with noop_stack(svc, svc.store_url(store), name) as stack:
        stack.start_worker(concurrency=concurrency)  # type: ignore[attr-defined]
        if dedicated:
            stack.start_worker(concurrency=1, queues=[cleanup_q])  # type: ignore[attr-defined]
        leases = [r.get(120)["lease_id"] for r in
                  [producer.acquire_lease(f"p-{uuid.uuid4().hex[:12]}")
                   for _ in range(2 * samples + 5)]]
        for lease_id in leases[:5]:  # warm-up
            producer.destroy_lease(lease_id).get(60)

        def destroy_latency(lease_id: str) -> float:
            started = time.perf_counter()
            producer.destroy_lease(lease_id).get(300)
            return time.perf_counter() - started

        idle = [destroy_latency(lease_id) for lease_id in leases[5:5 + samples]]
        queued = [producer.acquire_lease(f"q-{uuid.uuid4().hex[:12]}") for _ in range(backlog)]
        busy, queue_lengths = [], []
        for lease_id in leases[5 + samples:]:
            busy.append(destroy_latency(lease_id))
            queue_lengths.append(int(broker.llen(acquire_q)))  # type: ignore[arg-type]
        done = sum(r.ready() for r in queued)
        broker.delete(acquire_q)  # the rest of the backlog is not needed
    return {"setup": ("one worker + a -Q cleanup worker" if dedicated
                      else "one worker, every lane (the default)"),
            "worker_concurrency": concurrency,
            "idle_destroy_p50_ms": p50_ms(idle), "busy_destroy_p50_ms": p50_ms(busy),
            "busy_destroy_max_ms": round(max(busy) * 1000, 1),
            "ratio": round(p50_ms(busy) / p50_ms(idle), 2),
            "acquires_still_queued_first_last": [queue_lengths[0], queue_lengths[-1]],
            "acquires_done_when_busy_samples_ended": done,
            "valid": min(queue_lengths) > 0}


if __name__ == "__main__":
    main()
