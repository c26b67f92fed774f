"""The exporter's metrics: one prometheus-client Collector that, at each scrape, reads the
store's counts (gauges), tails the lease event log, the sweep tick log and the provider
error log by id (counters and histograms), and pings the workers.

A scrape always answers: the store's reads run in a thread of their own and are waited
for at most ``STORE_READ_DEADLINE_S`` (a store that does not answer is
``leasekeeper_store_up`` 0, not a hung scrape), and the pinger bounds the broker's part
(``leasekeeper_broker_up``).

Why from the store: every lease transition is one committed row of ``lease_events`` and
every beat tick one row of ``sweep_ticks``, every provider error one row of
``provider_errors``, whichever worker or pool process made it, so
one reader counts each exactly once with any number of prefork processes and workers, and
nothing in the task code has to know about metrics. Counters start at zero when the
exporter starts (Prometheus' ``rate()`` handles the reset); run one exporter per store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from models.observe import UNFINISHED_RUNS, Observe, TailedEvent
from models.pool_store import MEMBER_STATES, BreakerState, PoolStore
from models.schema import (
    LEASE_TRANSITIONS,
    LeaseState,
    ProviderErrorClass,
    ReclaimOutcome,
    SweepTick,
    TickRun,
    utcnow,
)
from providers.errors import LeasekeeperError
from workers.beat import SWEEPS
from workers.metrics.tail import IdTail, ReclaimTail
from workers.queues import Lane
from workers.settings import Settings

log = logging.getLogger("leasekeeper.metrics")
OTHER_TENANT = "other"
NO_STATUS = "none"  # the status label of a provider error without an HTTP status
_DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Acquire outcomes, by the state a provisioning lease moved to.
_ACQUIRE_OUTCOME = {LeaseState.ACTIVE: "active", LeaseState.PENDING_CLEANUP: "failed",
                    LeaseState.ABANDONED: "failed", LeaseState.DESTROYING: "cancelled"}
# A warm pool acquire's result: a claimed member became active, or a cold lease of a run
# that asked the pool (empty, or no member resumable) did.
CLAIMED, FALLBACK = "claimed", "fallback"
# Destroy outcomes, by the state a destroying lease moved to.
_DESTROY_OUTCOME = {LeaseState.DESTROYED: "destroyed", LeaseState.PENDING_CLEANUP: "failed",
                    LeaseState.ABANDONED: "abandoned"}

# A resume check that answered "not resumable" is the lease event active -> pending_cleanup
# with this reason prefix (the resume check, or a reuse at acquire); its reason, classified.
NOT_RESUMABLE_PREFIX = "not resumable: "
REASON_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gone", ("no longer exists", "never started")),
    ("exited", ("exited", "is Succeeded", "is Failed", "Finished")),
    ("terminating", ("terminating",)),
    ("not_ready", ("did not become Ready",)),
    ("no_pod", ("no backing pod",)),
)



@dataclass(frozen=True)
class Ping:
    """The workers of this installation that answered a ping, and how many consume each
    lane (a worker started with ``-Q`` consumes only some)."""
    workers: int
    lanes: Mapping[Lane, int]

    @classmethod
    def of(cls, served: Mapping[str, set[Lane]]) -> Ping:
        return cls(len(served), {lane: sum(lane in lanes for lanes in served.values())
                                 for lane in Lane})


# timeout -> the workers that answered within it; None: the broker was not reached.
# It returns within about the timeout, whatever the broker does (server.py).
Pinger = Callable[[float], Ping | None]
# How long a scrape waits for the store's reads (milliseconds, on a million leases: see
# README). A server that stops answering holds a read for good (no statement or TCP timeout
# ends it), so past this the scrape answers leasekeeper_store_up 0; the read goes on in its
# thread, and every scrape until it ends answers store_up 0 at once (none starts another).
STORE_READ_DEADLINE_S = 5.0


def utc_timestamp(moment: datetime) -> float:
    return (moment - datetime(1970, 1, 1)).total_seconds()


OTHER_REASON = "other"  # the reason class of a reason no needle matches


def reason_class(reason: str) -> str:
    for name, needles in REASON_CLASSES:
        if any(needle in reason for needle in needles):
            return name
    return OTHER_REASON


def rank_tenants(counts: Iterable[tuple[str, str, str, int]], top_n: int) -> set[str]:
    """The ``top_n`` tenants with the most leases (not destroyed; ties by name)."""
    totals: dict[str, int] = {}
    for _state, _provider, tenant, n in counts:
        totals[tenant] = totals.get(tenant, 0) + n
    ranked = sorted(totals, key=lambda t: (-totals[t], t))
    return set(ranked[:top_n])


class LeaseCollector(Collector):
    def __init__(self, observe: Observe, settings: Settings, ping: Pinger) -> None:
        self.observe, self.settings, self.ping = observe, settings, ping
        self._lock = threading.Lock()  # over _reading: one store read at a time
        self._reading: Future[list[Metric]] | None = None
        self._read_by = 0.0  # when the read in _reading is given up on (monotonic)
        self._events: IdTail | None = None
        self._ticks: IdTail | None = None
        self._errors: IdTail | None = None
        self._reclaims = ReclaimTail(utcnow())
        self.transitions = Counter(
            "leasekeeper_lease_transitions", "Lease state transitions.",
            ["from_state", "to_state", "provider"], registry=None)
        self.acquires = Counter(
            "leasekeeper_acquires", "Acquires ended, by outcome (active, failed, cancelled).",
            ["provider", "outcome"], registry=None)
        self.acquire_duration = Histogram(
            "leasekeeper_acquire_duration_seconds", "Intent recorded (a warm pool member: "
            "claimed) to lease active.",
            ["provider", "backend"], buckets=_DURATION_BUCKETS_S, registry=None)
        self.destroys = Counter(
            "leasekeeper_destroys", "Destroy attempts ended, by outcome.",
            ["provider", "outcome"], registry=None)
        self.destroy_duration = Histogram(
            "leasekeeper_destroy_duration_seconds", "Destroy claimed to its outcome.",
            ["provider", "backend", "outcome"], buckets=_DURATION_BUCKETS_S, registry=None)
        self.orphans = Counter(
            "leasekeeper_orphans_recorded", "Provider resources no lease accounted for, "
            "recorded by sweep.orphans.", ["provider"], registry=None)
        self.not_resumable = Counter(
            "leasekeeper_not_resumable", "Resume checks that answered not resumable, by "
            "reason class (gone, exited, terminating, not_ready, no_pod, other).",
            ["provider", "reason_class"], registry=None)
        self.reclaims = Counter("leasekeeper_run_reclaims", "Reclaims recorded, by outcome.",
                                ["outcome"], registry=None)
        for reclaim_outcome in ReclaimOutcome:
            self.reclaims.labels(reclaim_outcome.value)
        self.ticks = Counter("leasekeeper_sweep_ticks", "Beat ticks of each sweep by run.",
                             ["sweep", "run"], registry=None)
        self.tick_outcomes = Counter(
            "leasekeeper_sweep_outcomes", "Items each sweep handled, by outcome.",
            ["sweep", "outcome"], registry=None)
        self.tick_duration = Histogram(
            "leasekeeper_sweep_tick_duration_seconds", "Duration of ticks that ran.",
            ["sweep"], buckets=_DURATION_BUCKETS_S, registry=None)
        self.provider_errors = Counter(
            "leasekeeper_provider_errors", "ProviderErrors provider calls raised, by class "
            "(transient, terminal) and HTTP status ('none' without one).",
            ["provider", "error_class", "status"], registry=None)
        # Known label sets start at 0, so the first increment is an increase() too.
        for sweep in SWEEPS:
            for tick_run in TickRun:
                self.ticks.labels(sweep, tick_run.value)
        for provider in settings.providers:
            self.orphans.labels(provider)
            for frm, to in LEASE_TRANSITIONS:
                self.transitions.labels(frm.value if frm else "none", to.value, provider)
            for name in [*(name for name, _needles in REASON_CLASSES), OTHER_REASON]:
                self.not_resumable.labels(provider, name)
            for error_class in ProviderErrorClass:
                self.provider_errors.labels(provider, error_class.value, NO_STATUS)
            for outcome in sorted(set(_ACQUIRE_OUTCOME.values())):
                self.acquires.labels(provider, outcome)
            for outcome in sorted(set(_DESTROY_OUTCOME.values())):
                self.destroys.labels(provider, outcome)
        self.pool_claims = Counter(
            "leasekeeper_pool_claims", "Acquires naming a warm pool that ended active, by "
            "result: claimed (a warm member) or fallback (a cold start).",
            ["pool", "result"], registry=None)
        for pool in settings.pools:
            for result in (CLAIMED, FALLBACK):
                self.pool_claims.labels(pool.name, result)
        self._derived = [self.pool_claims, self.transitions, self.acquires, self.acquire_duration,
                         self.destroys, self.destroy_duration, self.orphans,
                         self.not_resumable, self.reclaims, self.ticks, self.tick_outcomes,
                         self.tick_duration, self.provider_errors]

    # -- scrape -----------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        gauges = self._read_store()
        yield GaugeMetricFamily("leasekeeper_store_up", "1 if the exporter could read the "
                                "store.", value=0 if gauges is None else 1)
        yield from gauges or []
        seen = self.ping(self.settings.metrics_worker_ping_timeout_s)
        yield GaugeMetricFamily("leasekeeper_broker_up", "1 if the exporter reached the "
                                "broker at this scrape.", value=0 if seen is None else 1)
        yield GaugeMetricFamily("leasekeeper_workers_up",
                                "Workers consuming this installation's queues "
                                "(LEASEKEEPER_TASK_QUEUE) that answered at this scrape.",
                                value=seen.workers if seen else 0)
        lanes = GaugeMetricFamily("leasekeeper_lane_workers",
                                  "Workers that answered at this scrape consuming each lane "
                                  "(queue) of this installation; 0: its tasks wait.",
                                  labels=["lane"])
        for lane in Lane:
            lanes.add_metric([lane.value], seen.lanes.get(lane, 0) if seen else 0)
        yield lanes
        intervals = GaugeMetricFamily("leasekeeper_sweep_interval_seconds",
                                      "Each sweep's beat interval.", labels=["sweep"])
        for sweep, field_name in SWEEPS.items():
            intervals.add_metric([sweep], float(getattr(self.settings, field_name)))
        yield intervals
        for metric in self._derived:
            yield from metric.collect()

    def _read_store(self) -> list[Metric] | None:
        """The store's gauges, with the logs tailed; None if the store failed, or did not
        answer within STORE_READ_DEADLINE_S of the read's start (scrapes at the same time
        share one read)."""
        with self._lock:
            if self._reading is None or self._reading.done():
                self._reading, self._read_by = Future(), time.monotonic() + STORE_READ_DEADLINE_S
                threading.Thread(target=self._read, args=(self._reading,), daemon=True,
                                 name="metrics-store-read").start()
            reading, read_by = self._reading, self._read_by
        try:
            return reading.result(timeout=max(read_by - time.monotonic(), 0.0))
        except TimeoutError:
            log.warning("metrics: the store did not answer within %g s", STORE_READ_DEADLINE_S)
        except LeasekeeperError as exc:  # no task here: the next scrape is the retry
            log.warning("metrics: store unreadable: %s; this scrape answers "
                        "leasekeeper_store_up 0, and the next scrape reads it again",
                        exc.outside_a_task())
        return None

    def _read(self, reading: Future[list[Metric]]) -> None:
        try:
            if self._events is None:  # the first read that reaches the store
                self._mark_start()
            gauges = list(self._store_gauges())
            self._tail()
            reading.set_result(gauges)
        except Exception as exc:  # the scrapes waiting for it report it
            reading.set_exception(exc)

    def _store_gauges(self) -> Iterable[Metric]:
        counts = self.observe.lease_counts()
        top = rank_tenants(counts, self.settings.metrics_tenant_top_n)
        # Every state of every provider and tenant label exported is a series, 0 when no
        # lease is in it: a series that vanished with its last lease reads "no data" to
        # dashboards and alerts, not 0. Bounded: states x providers x (top_n + 1) tenants.
        providers = set(self.settings.providers) | {provider for _s, provider, _t, _n in counts}
        leases: dict[tuple[str, str, str], int] = {
            (state, provider, tenant): 0 for state in LeaseState if state != LeaseState.DESTROYED
            for provider in providers for tenant in top | {OTHER_TENANT}}
        abandoned = 0
        for state, provider, tenant, n in counts:
            key = (state, provider, tenant if tenant in top else OTHER_TENANT)
            leases[key] = leases.get(key, 0) + n
            abandoned += n if state == LeaseState.ABANDONED else 0
        family = GaugeMetricFamily(
            "leasekeeper_leases", "Leases not destroyed, by state, provider and tenant (the "
            "top LEASEKEEPER_METRICS_TENANT_TOP_N tenants; the rest as 'other').",
            labels=["state", "provider", "tenant"])
        for (state, provider, tenant), n in sorted(leases.items()):
            family.add_metric([state, provider, tenant], n)
        yield family
        yield GaugeMetricFamily("leasekeeper_leases_abandoned",
                                "Leases waiting for an operator.", value=abandoned)
        since = self.observe.oldest_cleanup_wait_since()
        yield GaugeMetricFamily(
            "leasekeeper_cleanup_oldest_wait_seconds", "How long the longest-waiting lease "
            "in pending_cleanup or destroying has needed cleanup (0: none).",
            value=max((utcnow() - since).total_seconds(), 0.0) if since else 0.0)
        runs = GaugeMetricFamily("leasekeeper_runs", "Runs not finished, by status "
                                 "(running, interrupted).", labels=["status"])
        counted = self.observe.run_counts()
        for status in UNFINISHED_RUNS:
            runs.add_metric([status], counted.get(status, 0))
        yield runs
        last = GaugeMetricFamily("leasekeeper_sweep_last_tick_timestamp_seconds",
                                 "When each sweep last ticked, by run (ran, skipped, failed).",
                                 labels=["sweep", "run"])
        for sweep, run, at in sorted(self.observe.last_ticks()):
            last.add_metric([sweep, run], utc_timestamp(at))
        yield last
        yield from self._pool_gauges()

    def _pool_gauges(self) -> Iterable[Metric]:
        """Every declared pool, and every removed one while members of it exist (they
        drain): members by state, size, breaker, fill failures."""
        pools = PoolStore(self.observe.store)
        breakers = pools.breakers()
        declared = {p.name: p for p in self.settings.pools}
        counted = pools.member_counts(sorted(set(declared) | set(breakers)))
        names = [name for name, counts in counted.items()
                 if name in declared or any(counts.values())]
        members = GaugeMetricFamily(
            "leasekeeper_pool_members", "Unclaimed warm pool members that exist, by state "
            "(provisioning, warm, pending_cleanup, destroying).", labels=["pool", "state"])
        for name in names:
            for state in MEMBER_STATES:
                members.add_metric([name, state], counted[name][state])
        yield members
        size = GaugeMetricFamily("leasekeeper_pool_size", "Each declared pool's size.",
                                 labels=["pool"])
        max_size = GaugeMetricFamily("leasekeeper_pool_max_size",
                                     "Each declared pool's max_size.", labels=["pool"])
        for name, pool in sorted(declared.items()):
            size.add_metric([name], pool.size)
            max_size.add_metric([name], pool.max_size)
        yield size
        yield max_size
        now, threshold = utcnow(), self.settings.pool_breaker_threshold
        open_ = GaugeMetricFamily(
            "leasekeeper_pool_breaker_open", "1 while a pool's circuit breaker stops (open) "
            "or limits to one probe (half open) its member creates.", labels=["pool"])
        failures = CounterMetricFamily(
            "leasekeeper_pool_fill_failures", "Pool members whose create failed (or that "
            "never became ready), counted by their pool's breaker.", labels=["pool"])
        for name in names:
            breaker = breakers.get(name)
            closed = breaker is None or breaker.state(threshold, now) == BreakerState.CLOSED
            open_.add_metric([name], 0 if closed else 1)
            failures.add_metric([name], breaker.failures_total if breaker else 0)
        yield open_
        yield failures

    # -- the logs, tailed ------------------------------------------------------------
    def start_counting(self) -> None:
        """Mark where the logs stand now, before the exporter serves, so its counters count
        from its start and not from its first scrape: a first store read, bounded as a
        scrape's. A store that does not answer in time is marked when it does."""
        self._read_store()

    def _mark_start(self) -> None:
        """Every log is counted from here on (all three marked, or none)."""
        since = utcnow()
        events, ticks, errors = (self.observe.max_event_id(), self.observe.max_tick_id(),
                                 self.observe.max_provider_error_id())
        self._events, self._ticks, self._errors = (
            IdTail(events + 1), IdTail(ticks + 1), IdTail(errors + 1))
        self._reclaims = ReclaimTail(since)

    def _tail(self) -> None:
        assert self._events is not None and self._ticks is not None and self._errors is not None
        limit = self.settings.metrics_events_batch_size
        self._count_events(self._events.poll(self.observe.events_from, limit))
        for tick in self._ticks.poll(self.observe.ticks_from, limit):
            self._count_tick(tick)
        for error in self._errors.poll(self.observe.provider_errors_from, limit):
            self.provider_errors.labels(
                error.provider, error.error_class,
                NO_STATUS if error.status is None else str(error.status)).inc()
        for outcome in self._reclaims.poll(self.observe.reclaims_since):
            self.reclaims.labels(outcome).inc()

    def _count_events(self, events: list[TailedEvent]) -> None:
        # When each destroyed lease's destroy was claimed: before this batch from the
        # store, then as the batch goes.
        claimed_at = self.observe.last_entered(
            sorted({e.lease_id for e in events if e.from_state == LeaseState.DESTROYING}),
            LeaseState.DESTROYING, min((e.id for e in events), default=0))
        for e in events:
            self.transitions.labels(e.from_state or "none", e.to_state, e.provider).inc()
            backend = e.backend or ""
            if e.to_state == LeaseState.DESTROYING:
                claimed_at[e.lease_id] = e.at
            if (e.from_state == LeaseState.ACTIVE and e.to_state == LeaseState.PENDING_CLEANUP
                    and e.reason.startswith(NOT_RESUMABLE_PREFIX)):
                self.not_resumable.labels(e.provider, reason_class(e.reason)).inc()
            if e.from_state is None and e.to_state == LeaseState.PENDING_CLEANUP:
                self.orphans.labels(e.provider).inc()
            if (e.pool and e.from_state == LeaseState.PROVISIONING
                    and e.to_state == LeaseState.ACTIVE):
                self.pool_claims.labels(e.pool, CLAIMED if e.claimed_at else FALLBACK).inc()
            if (e.from_state == LeaseState.PROVISIONING and e.to_state in _ACQUIRE_OUTCOME
                    and not (e.pool and e.run_id is None)):
                # (a pool member no run holds failing, made by a fill or let go by a claim
                # that went on to another member, is no run's acquire: the pool's breaker
                # and fill failures count it)
                outcome = _ACQUIRE_OUTCOME[LeaseState(e.to_state)]
                self.acquires.labels(e.provider, outcome).inc()
                if outcome == "active":  # a claimed member: since its claim, not its making
                    self.acquire_duration.labels(e.provider, backend).observe(
                        max((e.at - (e.claimed_at or e.created_at)).total_seconds(), 0.0))
            if e.from_state == LeaseState.DESTROYING and e.to_state in _DESTROY_OUTCOME:
                outcome = _DESTROY_OUTCOME[LeaseState(e.to_state)]
                self.destroys.labels(e.provider, outcome).inc()
                start = claimed_at.get(e.lease_id)
                if start is not None:
                    self.destroy_duration.labels(e.provider, backend, outcome).observe(
                        max((e.at - start).total_seconds(), 0.0))

    def _count_tick(self, tick: SweepTick) -> None:
        self.ticks.labels(tick.sweep, tick.run).inc()
        if tick.run != "ran":
            return
        self.tick_duration.labels(tick.sweep).observe(tick.took_ms / 1000)
        for outcome, n in (tick.counts or {}).items():
            # *_total entries of a summary are gauges (e.g. abandoned_total), not events.
            if isinstance(n, int) and not outcome.endswith("_total"):
                self.tick_outcomes.labels(tick.sweep, outcome).inc(n)
