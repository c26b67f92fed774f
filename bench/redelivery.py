"""How long a task waits after its worker dies, against the visibility timeout. Prints JSON.

Two ways a task loses its worker:

- baseline: a pool process is SIGKILLed mid-task (the ``faulty`` provider's
  ``kill_worker`` fault in an acquire). The worker's main process sees it and requeues the
  message at once (``task_reject_on_worker_lost``);
- the whole worker is SIGKILLed (main process and pool) right after it took the message.
  Nobody is left to requeue it: Redis hands it out again only once the visibility timeout
  has passed since it was taken, and only when a live worker's restore sweep next runs
  (kombu scans every ``unacked_restore_interval`` x ``unacked_restore_throttle``, 10 x 10 s).
  A replacement worker is started right after the kill, as a supervisor would.

The visibility timeout is shortened (``--visibility-s``, default 30) so a trial takes
minutes, not an hour; the delay beyond it is the restore sweep's, the same at any timeout.

    python bench/redelivery.py [--visibility-s 30] [--trials 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    parser.add_argument("--visibility-s", type=float, default=30.0)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    visibility = args.visibility_s

    from tests.services import free_port, start_redis

    work = Path(tempfile.mkdtemp(prefix="lk-bench-redelivery-"))
    port = free_port()
    settings = {"LEASEKEEPER_BROKER_URL": f"redis://127.0.0.1:{port}/0",
                "LEASEKEEPER_PROVIDERS": "local,noop,faulty",
                "LEASEKEEPER_VISIBILITY_TIMEOUT_S": str(visibility),
                "LEASEKEEPER_TASK_TIME_LIMIT_S": str(visibility / 2),
                "LEASEKEEPER_TASK_SOFT_TIME_LIMIT_S": str(visibility / 3)}
    os.environ.update(settings)
    redis = start_redis(work / "redis", port)
    try:
        baseline = [child_killed(work, settings, i) for i in range(args.trials)]
        whole = [worker_killed(work, settings, i, visibility) for i in range(args.trials)]
    finally:
        redis.stop()
    worst = max(whole)
    print(json.dumps({
        "benchmark": "redelivery_after_worker_death",
        "visibility_timeout_s": visibility,
        "trials": args.trials,
        "pool_process_killed_s": [round(x, 2) for x in baseline],
        "whole_worker_killed_s": [round(x, 2) for x in whole],
        "whole_worker_killed_worst_s": round(worst, 2),
        "beyond_visibility_timeout_worst_s": round(worst - visibility, 2),
        "ratio_worst_vs_visibility_timeout": round(worst / visibility, 2),
        "ratio_worst_vs_pool_process_killed": round(worst / statistics.median(baseline), 1),
    }, indent=2))


def _stack(work: Path, settings: dict[str, str], tag: str):  # type: ignore[no-untyped-def]
    from models.migrate import upgrade
    from tests.stack import WorkerStack

    root = work / tag
    root.mkdir(parents=True)
    url = f"sqlite:///{root / 'store.db'}"
    upgrade(url)
    return WorkerStack(name=f"bench-{tag}", store_url=url, root=root,
                       broker_url=settings["LEASEKEEPER_BROKER_URL"], extra_env=settings)


def child_killed(work: Path, settings: dict[str, str], trial: int) -> float:
    from tasks import producer

    stack = _stack(work, settings, f"child-{trial}")
    stack.start_worker(concurrency=1)
    try:
        stack.faults.write({"acquire": [{"fault": "kill_worker", "when": "before", "times": 1}]})
        started = time.monotonic()
        result = producer.acquire_lease(f"bench-{uuid.uuid4().hex[:8]}", {"provider": "faulty"})
        lease = result.get(timeout=300)
        took = time.monotonic() - started
        producer.destroy_lease(lease["lease_id"]).get(timeout=60)
        return took
    finally:
        stack.stop()


def worker_killed(work: Path, settings: dict[str, str], trial: int, visibility: float) -> float:
    import redis as redis_lib

    from workers.app import app

    stack = _stack(work, settings, f"whole-{trial}")
    first = stack.start_worker(concurrency=1)
    broker = redis_lib.Redis.from_url(settings["LEASEKEEPER_BROKER_URL"])
    try:
        # A task the worker takes and holds (its countdown), so it dies with it unacked.
        result = app.send_task("leasekeeper.ping", countdown=2)
        deadline = time.monotonic() + 60
        while not broker.hlen("unacked"):
            assert time.monotonic() < deadline, "the worker never took the message"
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        killed = time.monotonic()
        stack.start_worker(concurrency=1)  # the replacement a supervisor starts
        result.get(timeout=visibility + 600)
        return time.monotonic() - killed
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
