"""The demo workload `leasekeeper up --demo N` drives through the producer API.

Each run follows one scenario, cycling through them; the demo prints every lease event as
it happens (with its time and the full lease id, as `leasekeeper leases show` takes it)
and, at the end, checks that each lease reached the state its scenario should, each run
its status and exit code, and that no sandbox the demo created is left running. Leases
made by anything else (a producer call in another shell) are not the demo's business.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from models.schema import LeaseState
from models.store import Store
from workers.runtime import Runtime


@dataclass(frozen=True)
class Scenario:
    name: str
    spec: dict[str, Any]
    expected_end: str  # the lease's end_reason once the demo is over
    expected_run: tuple[str, int | None] | None = None  # the run's (status, exit code)
    # A command that exits by itself gets no resume check: on a slow host the check could
    # see it exited first, and end the lease as not resumable before the sweep finishes it.
    resume_check: bool = True


SCENARIOS = [
    Scenario("finishes, sandbox reclaimed", {}, "reclaim"),
    Scenario("viewer leaves, run reaped after the detach TTL", {}, "reclaim"),
    Scenario("sandbox command exits 3: sweep.finish_exited fails the run, sandbox reclaimed",
             {"command": ["sh", "-c", "sleep 1; exit 3"]}, "reclaim", ("failed", 3),
             resume_check=False),
    Scenario("idle past its timeout, expired by the sweep", {"idle_timeout_s": 2}, "idle"),
    Scenario("two runs of one thread share a reused sandbox", {"reuse": True}, "requested"),
]


def _say(line: str, at: datetime | None = None) -> None:
    print(f"{(at or datetime.now()):%H:%M:%S} {line}", flush=True)


class EventTail:
    """Prints lease events from the store as they are appended."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.last_id = 0

    def poll(self) -> None:
        from sqlalchemy import select

        from models.schema import LeaseEvent

        with self.store.tx() as s:
            events = list(s.scalars(select(LeaseEvent).where(LeaseEvent.id > self.last_id)
                                    .order_by(LeaseEvent.id)))
        for e in events:
            self.last_id = e.id
            _say(f"  lease {e.lease_id}  {e.from_state or '-':>15} → {e.to_state:<15} "
                 f"{e.reason}", at=_local(e.at))


def run_demo(rt: Runtime, count: int, runs: list[str] | None = None,
             timeout_s: float = 120.0) -> bool:
    """Drive ``count`` runs; each run id is appended to ``runs`` before its acquire is sent
    (so an interrupted demo knows which leases are its own)."""
    from tasks import producer

    tail = EventTail(rt.store)
    tail.last_id = _max_event_id(rt.store)
    expectations: dict[str, tuple[Scenario, str]] = {}
    for i in range(count):
        scenario = SCENARIOS[i % len(SCENARIOS)]
        run_id = f"demo-{i}-{uuid.uuid4().hex[:6]}"
        thread = f"thread-{i}"
        _say(f"run {run_id}: {scenario.name}")
        if runs is not None:
            runs.append(run_id)
        lease = producer.acquire_lease(run_id, {"tenant": "demo", "thread_id": thread,
                                                **scenario.spec}).get(60)
        lease_id = lease["lease_id"]
        expectations[lease_id] = (scenario, run_id)
        tail.poll()
        if scenario.resume_check:
            check = producer.check_resumable(lease_id).get(60)
            _say(f"  resume check: {'resumable' if check['resumable'] else check['reason']}")
        if i % len(SCENARIOS) == 0:
            producer.finish_run(run_id, "completed", 0).get(30)
        elif i % len(SCENARIOS) == 1:
            producer.detach_run(run_id).get(30)
        elif scenario.expected_end == "requested":
            second = f"{run_id}-again"
            if runs is not None:
                runs.append(second)
            again = producer.acquire_lease(second, {"tenant": "demo", "thread_id": thread,
                                                    **scenario.spec}).get(60)
            _say(f"  second run {second}: {again['result']} lease {again['lease_id']}")
            producer.finish_run(run_id, "completed", 0).get(30)
            producer.finish_run(second, "completed", 0).get(30)
            producer.destroy_lease(lease_id).get(60)
        tail.poll()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tail.poll()
        leases = {lid: rt.store.get_lease(lid) for lid in expectations}
        if all(lease.state == LeaseState.DESTROYED for lease in leases.values()):
            break
        time.sleep(0.5)
    return _report(rt, expectations)


def _local(naive_utc: datetime) -> datetime:
    """A store time (naive UTC) in local time, like the other lines."""
    from datetime import UTC

    return naive_utc.replace(tzinfo=UTC).astimezone()


def _max_event_id(store: Store) -> int:
    from sqlalchemy import func, select

    from models.schema import LeaseEvent

    with store.tx() as s:
        return int(s.scalar(select(func.coalesce(func.max(LeaseEvent.id), 0))) or 0)


def _report(rt: Runtime, expectations: dict[str, tuple[Scenario, str]]) -> bool:
    ok = True
    print(flush=True)
    _say("summary:")
    for lease_id, (scenario, run_id) in expectations.items():
        lease = rt.store.get_lease(lease_id)
        run = rt.store.get_run(run_id)
        good = lease.state == LeaseState.DESTROYED and (lease.end_reason or "").startswith(
            scenario.expected_end) and (scenario.expected_run is None or (
                run is not None and (run.status, run.exit_code) == scenario.expected_run))
        ok &= good
        run_text = (f"run {run.status}" + (f" exit {run.exit_code}" if run.exit_code is not None
                                           else "")) if run else "run missing"
        _say(f"  {'ok ' if good else 'BAD'} lease {lease_id} {lease.state:<10} "
             f"end={lease.end_reason!s:<10} {run_text:<20} ({scenario.name})")
    names = {rt.store.get_lease(lease_id).provider_lease_id for lease_id in expectations}
    leftovers = [r.name for r in rt.provider(rt.settings.provider).list_managed()
                 if r.name in names]
    if leftovers:
        ok = False
        _say(f"  BAD {len(leftovers)} sandbox(es) the demo created still running: "
             f"{', '.join(leftovers)}")
    return ok
