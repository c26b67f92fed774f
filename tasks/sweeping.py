"""What every sweep shares: the single-flight lock, outcome tallies, the summary Flower
shows as the task result, and the seam through which sweeps enqueue follow-up tasks.

A sweep body is ``body(ctx: SweepContext) -> Tally``. It decides first (reads only), then,
unless ``ctx.dry_run``, claims rows with guarded updates (models/sweep_store.py) and acts;
its tally counts every item by an outcome enum. ``run_sweep`` wraps a body in its Redis
single-flight lock (with an expiry, so a dead sweep never blocks the next) and turns the
tally into the summary: ``{"sweep": name, "run": ran|skipped|dry_run, "took_ms": ...,
<outcome>: count, ..., "items": ["<outcome> <id>", ...]}``. Every outcome key is always
present, so a zero is visible too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import redis

from models.schema import utcnow
from models.sweep_store import SweepStore
from providers.base import ManagedResource
from providers.errors import (
    NEXT_TICK,
    ConfigError,
    LeasekeeperError,
    ProviderError,
    StoreUnavailable,
    for_a_sweep,
)
from tasks.base import LeaseTask
from workers.runtime import Runtime

log = logging.getLogger("leasekeeper.sweeps")
Summary = dict[str, Any]
MAX_ITEMS = 50  # ids listed in one summary; the counts are always complete


class SweepRun(StrEnum):
    RAN = "ran"
    SKIPPED = "skipped"  # another tick (another beat, another worker) holds the lock
    DRY_RUN = "dry_run"  # decided only; nothing was claimed, written or enqueued


@dataclass
class Tally:
    """Counts by outcome (every member of the enum, zeros included) and the ids behind them."""

    outcomes: type[StrEnum]
    counts: dict[str, int] = field(default_factory=dict)
    items: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for member in self.outcomes:
            self.counts.setdefault(member.value, 0)

    def add(self, outcome: StrEnum, ident: str | None = None, detail: str = "") -> None:
        self.counts[outcome.value] += 1
        if ident is not None and len(self.items) < MAX_ITEMS:
            self.items.append(f"{outcome.value} {ident}{f' ({detail})' if detail else ''}")

    def __getitem__(self, outcome: StrEnum) -> int:
        return self.counts[outcome.value]


class Effects(Protocol):
    """How a sweep starts follow-up work. Celery in production; a recorder in tests."""

    def reclaim(self, run_id: str) -> None: ...

    def destroy(self, lease_id: str, reason: str) -> None: ...

    def provision(self, lease_id: str) -> None: ...


@dataclass(frozen=True)
class SweepContext:
    """What one tick of a sweep works with."""

    rt: Runtime
    effects: Effects
    dry_run: bool = False
    task_id: str | None = None  # recorded on every lease event the tick writes

    @property
    def claims(self) -> SweepStore:
        return SweepStore(self.rt.store)


SweepBody = Callable[[SweepContext], Tally]


def lock_key(queue: str, sweep: str) -> str:
    """The sweep's single-flight lock, one per installation (``LEASEKEEPER_TASK_QUEUE``, as
    the heartbeats of workers/heartbeats.py): installations sharing a Redis never skip each
    other's ticks. Before, the key was ``leasekeeper:sweep:<name>`` for every installation;
    a worker of that version and one of this do not exclude each other (README, Sweeps)."""
    return f"leasekeeper:{queue}:sweep:{sweep}:lock"


@contextlib.contextmanager
def single_flight(rt: Runtime, sweep: str) -> Iterator[bool]:
    """Hold the sweep's Redis lock while the body runs; yield False if another holds it."""
    lock = rt.redis().lock(lock_key(rt.settings.task_queue, sweep),
                           timeout=max(rt.settings.sweep_lock_ttl_s, 1.0), blocking=False)
    try:
        acquired = bool(lock.acquire(blocking=False))
    except redis.RedisError as exc:
        from tasks.broker_words import broker_unreachable  # the URL, its setting, the fix

        reason = broker_unreachable(rt.settings.effective_broker_url, exc, sending=False)
        raise StoreUnavailable(f"Redis lock for {sweep} unavailable: {reason}") from None
    try:
        yield acquired
    finally:
        if acquired:
            # An expired lock (a tick longer than its TTL) is no error: claims kept it safe.
            with contextlib.suppress(redis.RedisError, redis.exceptions.LockError):
                lock.release()


def run_sweep(name: str, body: SweepBody, ctx: SweepContext) -> Summary:
    """One tick of a sweep: locked (unless a dry run, which writes nothing), summarised."""
    started = time.monotonic()
    if ctx.dry_run:
        return _summary(name, SweepRun.DRY_RUN, body(ctx), started)
    from workers.heartbeats import (  # read by `leasekeeper status`
        mark_sweep,
        mark_sweep_failed,
        mark_sweep_running,
        unmark_sweep_running,
    )

    client, queue = ctx.rt.redis(), ctx.rt.settings.task_queue
    with single_flight(ctx.rt, name) as mine:
        if not mine:
            return {"sweep": name, "run": SweepRun.SKIPPED.value, "took_ms": 0}
        # A long tick (stuck_provisioning waits for readiness) is running, not late.
        mark_sweep_running(client, queue, name, ctx.rt.settings.sweep_lock_ttl_s)
        try:
            tally = body(ctx)
        except Exception as exc:
            said = for_a_sweep(exc)
            error = (str(said).replace(NEXT_TICK, "") if isinstance(said, LeasekeeperError)
                     else f"{type(said).__name__}: {said}")
            mark_sweep_failed(client, queue, name, error)
            if said is exc:
                raise
            raise said from None
        else:
            summary = _summary(name, SweepRun.RAN, tally, started)
            mark_sweep(client, queue, summary)
        finally:
            unmark_sweep_running(client, queue, name)
    if any(tally.counts.values()):
        log.info("%s: %s", name, {k: v for k, v in summary.items() if k != "items"})
    return summary


def _summary(name: str, run: SweepRun, tally: Tally, started: float) -> Summary:
    return {"sweep": name, "run": run.value,
            "took_ms": round((time.monotonic() - started) * 1000), **tally.counts,
            "items": tally.items}


class CeleryEffects:
    """Follow-up work as lifecycle tasks, so each shows up in Flower on its own."""

    def reclaim(self, run_id: str) -> None:
        from tasks.reclaim import reclaim

        reclaim.apply_async(kwargs={"run_id": run_id})

    def destroy(self, lease_id: str, reason: str) -> None:
        from tasks.destroy import destroy

        destroy.apply_async(kwargs={"lease_id": lease_id, "reason": reason})

    def provision(self, lease_id: str) -> None:
        from tasks.pool_fill import provision

        provision.apply_async(kwargs={"lease_id": lease_id})


@dataclass(frozen=True)
class Listing:
    """What one enabled provider said it manages, and when it was asked."""

    provider: str
    resources: list[ManagedResource]
    listed_at: datetime
    error: str | None = None


def list_provider(rt: Runtime, name: str) -> Listing:
    """Ask one provider for its resources; a failure is reported in the listing."""
    listed_at = utcnow()
    try:
        return Listing(name, rt.provider(name).list_managed(), listed_at)
    except (ProviderError, ConfigError) as exc:
        log.warning("provider %s could not list its resources: %s", name, exc)
        return Listing(name, [], listed_at, str(exc)[:300])


def list_providers(rt: Runtime) -> list[Listing]:
    """Every enabled provider's listing; a failing provider does not stop the others."""
    return [list_provider(rt, name) for name in rt.settings.providers]


def naive_utc(moment: datetime) -> datetime:
    """The store's time format (naive UTC) for a provider's timestamp."""
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment


def sweep_task(task: LeaseTask, name: str, body: SweepBody) -> Summary:
    """A beat tick: no retries (the next tick is the retry); a failure shows in Flower."""
    return run_sweep(name, body, SweepContext(task.runtime, CeleryEffects(),
                                              task_id=task.request.id))
