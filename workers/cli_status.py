"""`leasekeeper status` (one screen for the on-call engineer) and `leasekeeper health`
(liveness and readiness probes: fast, quiet on success).

status shows leases by state and provider, abandoned leases with their reasons, the oldest
pending_cleanup, runs by status, the warm pools, each sweep's last tick
(workers/heartbeats.py), workers online, queue lengths, and a verdict. It exits 1 when
something needs a person: abandoned leases, a warm pool whose circuit breaker stopped its
creates or whose template its provider refuses, a sweep that has not run within three of
its intervals, no worker, a lane with tasks waiting that no worker consumes
(workers/cli_lanes.py), a service down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

import redis
import typer

from providers.errors import LeasekeeperError
from workers.beat import STALE_INTERVALS, SWEEPS
from workers.cli_common import ExitCode, age, emit_json, human_duration, iso, runtime, table
from workers.cli_leases import JsonOpt
from workers.settings import Settings, get_settings


def register(cli: typer.Typer) -> None:
    cli.command()(status)
    cli.command()(health)


class Check(StrEnum):
    BROKER = "broker"
    STORE = "store"
    WORKER = "worker"
    BEAT = "beat"


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth knowing; no person needed

    @property
    def ok(self) -> bool:
        return not self.problems


def _redis(settings: Settings) -> redis.Redis[bytes]:
    return redis.Redis.from_url(settings.effective_broker_url, socket_timeout=2,
                                socket_connect_timeout=2)


def no_worker(node: str | None, queue: str) -> str:
    """What a missing worker means, said the same way by status and health."""
    if node:
        return (f"worker {node} does not answer, or does not consume this installation's "
                f"queues (LEASEKEEPER_TASK_QUEUE={queue}): start it with this "
                "installation's settings")
    return (f"no worker of this installation answers (none consumes its queues, "
            f"LEASEKEEPER_TASK_QUEUE={queue}): start one (celery -A workers.app worker -E) "
            "with this installation's settings")


def sweep_ticks(settings: Settings, client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    """Each sweep's last tick; late when older than three intervals (or, never run, when
    beat started longer ago than that), unless a tick is running now (it holds the sweep's
    lock: a long one is working, not late)."""
    from workers.heartbeats import beat_started, last_failures, last_sweeps, running_sweeps

    now = time.time()
    ticks = last_sweeps(client, settings.task_queue, list(SWEEPS))
    failures = last_failures(client, settings.task_queue, list(SWEEPS))
    running = running_sweeps(client, settings.task_queue, list(SWEEPS))
    started = beat_started(client, settings.task_queue)
    rows = []
    for name, tick in ticks.items():
        interval = float(getattr(settings, SWEEPS[name]))
        at = float(tick["at"]) if tick else None
        since = at if at is not None else started
        late = running[name] is None and (
            since is None or now - since > STALE_INTERVALS * interval)
        counts = {k: v for k, v in (tick or {}).items()
                  if k not in {"sweep", "run", "took_ms", "at"}}
        failure = failures[name]  # only when newer than the last tick that ran
        if failure is not None and at is not None and float(failure["at"]) <= at:
            failure = None
        rows.append({"sweep": name, "interval_s": interval, "last_tick_at": at,
                     "ago_s": None if at is None else round(now - at, 1), "late": late,
                     "running_since": running[name],
                     "took_ms": (tick or {}).get("took_ms"), "counts": counts,
                     "last_failure": failure})
    return rows


def collect(settings: Settings) -> tuple[dict[str, Any], Verdict]:
    from models.reports import overview
    from workers.heartbeats import last_beat

    verdict = Verdict()
    report: dict[str, Any] = {"broker": None, "store": None}
    try:
        rt = runtime()
        ov = overview(rt.store)
        from workers.preflight import check_store_writable

        try:
            check_store_writable(settings.effective_store_url)
        except LeasekeeperError as exc:  # it reads, so the rest of the report still shows
            verdict.problems.append(f"store: {exc.outside_a_task()}")
            report["store_writable"] = False
        else:
            report["store_writable"] = True
        oldest = ov.oldest_pending_cleanup
        report["store"] = {
            "leases": ov.leases, "runs": ov.runs, "abandoned_total": ov.abandoned_total,
            "abandoned": [{"lease_id": x.lease_id, "provider": x.provider,
                           "end_reason": x.end_reason, "last_error": x.last_error,
                           "since": x.updated_at} for x in ov.abandoned],
            "oldest_pending_cleanup": None if oldest is None else {
                "lease_id": oldest.lease_id, "since": oldest.updated_at,
                "attempts": oldest.cleanup_attempts, "last_error": oldest.last_error}}
        if ov.abandoned_total:
            verdict.problems.append(f"{ov.abandoned_total} abandoned lease(s) wait for an "
                                    "operator (leasekeeper leases list --state abandoned)")
        from workers.cli_pools import pool_rows

        report["pools"] = pool_rows(rt)
        for pool in report["pools"]:
            if pool["template_refused"]:
                verdict.problems.append(
                    f"warm pool {pool['pool']} creates no member and every run asking it "
                    f"fails: {(pool['last_error'] or '')[:300]} (breaker {pool['breaker']}, "
                    f"{pool['consecutive_failures']} failed in a row); fix the pool's "
                    "template in LEASEKEEPER_POOLS or LEASEKEEPER_POOLS_FILE, then restart "
                    "the workers and beat")
            elif pool["breaker"] != "closed":
                verdict.problems.append(
                    f"warm pool {pool['pool']} stopped creating members after "
                    f"{pool['consecutive_failures']} failed in a row (breaker "
                    f"{pool['breaker']}): see `leasekeeper pools` for the last error")
    except LeasekeeperError as exc:
        verdict.problems.append(f"store: {exc.outside_a_task()}")
    client = _redis(settings)
    try:
        client.ping()
        from workers.cli_lanes import idle, lane_rows, lanes_online, unserved
        from workers.preflight import refuses_writes

        if refuses_writes(client):  # it reads: the rest of the report still shows
            from tasks.broker_words import broker_full

            verdict.problems.append(broker_full(settings.effective_broker_url, sending=False))

        queue = settings.task_queue
        served = lanes_online(1.0, queue)
        report["lanes"] = lane_rows(client, queue, served)  # every lane, in poll order
        lanes = {row["queue"]: row["waiting"] for row in report["lanes"]}
        report["broker"] = {"url_host": settings.effective_broker_url.rsplit("@", 1)[-1],
                            "queue": queue, "queued": sum(lanes.values()), "queues": lanes,
                            "unacked": int(client.hlen("unacked"))}
        report["sweeps"] = sweep_ticks(settings, client)
        beat_at = last_beat(client, queue)
        report["beat"] = {"last_tick_at": beat_at}
        if beat_at is None:
            verdict.problems.append("beat is not running (no tick marked): start it "
                                    "(celery -A workers.app beat)")
        for tick in report["sweeps"]:
            if tick["late"] and beat_at is not None:
                failed = tick["last_failure"]
                why = ("are the workers busy?" if failed is None else
                       f"its last tick failed {human_duration(time.time() - failed['at'])} "
                       f"ago: {failed['error']}")
                verdict.problems.append(
                    f"{tick['sweep']} has not run within {STALE_INTERVALS} intervals "
                    f"({STALE_INTERVALS * tick['interval_s']:g} s): {why}")
        report["workers"] = sorted(served)
        if not served:
            verdict.problems.append(no_worker(None, queue))
        else:  # no worker at all is said once, above, not once more per lane
            verdict.problems += unserved(report["lanes"])
            verdict.notes += idle(report["lanes"])
    except redis.RedisError as exc:
        from tasks.broker_words import broker_unreachable

        problem = broker_unreachable(settings.effective_broker_url, exc, sending=False)
        if problem not in verdict.problems:  # a full Redis, already said
            verdict.problems.append(problem)
    finally:
        client.close()
    report["verdict"] = {"ok": verdict.ok, "problems": verdict.problems,
                         "notes": verdict.notes}
    return report, verdict


def status(as_json: JsonOpt = False) -> None:
    """One screen: leases, runs, sweeps, workers, queues and a verdict (exit 1: act)."""
    settings = get_settings()
    report, verdict = collect(settings)
    if as_json:
        emit_json(report)
    else:
        _print(report)
    raise typer.Exit(ExitCode.OK if verdict.ok else ExitCode.NEEDS_ATTENTION)


def _print(report: dict[str, Any]) -> None:
    from datetime import UTC, datetime

    store = report.get("store")
    if store:
        providers = sorted({p for by in store["leases"].values() for p in by})
        states = sorted(store["leases"])
        typer.echo("leases")
        typer.echo(_indent(table(["state", *providers, "total"],
                                 [[s, *(store["leases"][s].get(p, 0) for p in providers),
                                   sum(store["leases"][s].values())] for s in states])
                           if states else "none"))
        for lease in store["abandoned"]:
            typer.echo(f"  abandoned {lease['lease_id']} ({lease['provider']}, "
                       f"{lease['end_reason'] or '-'}): {lease['last_error'] or 'no error'}")
        oldest = store["oldest_pending_cleanup"]
        if oldest:
            typer.echo(f"  oldest pending_cleanup: {oldest['lease_id']}, since "
                       f"{iso(oldest['since'])} ({age(oldest['since'])}), "
                       f"{oldest['attempts']} attempt(s)")
        typer.echo("runs: " + (", ".join(f"{n} {s}" for s, n in sorted(store["runs"].items()))
                               or "none"))
    for pool in report.get("pools") or []:
        typer.echo(f"pool {pool['pool']}: {pool['warm']} warm of {pool['size']} (max "
                   f"{pool['max_size']}), {pool['provisioning']} provisioning, "
                   f"{pool['draining']} draining; breaker {pool['breaker']}"
                   + ("; template refused" if pool["template_refused"] else ""))
    if report.get("sweeps") is not None:
        typer.echo("sweeps")
        typer.echo(_indent(table(
            ["sweep", "every", "last tick", "ago", "took", "did"],
            [[t["sweep"], f"{t['interval_s']:g}s",
              datetime.fromtimestamp(t["last_tick_at"], UTC).strftime("%H:%M:%SZ")
              if t["last_tick_at"] else "never",
              human_duration(t["ago_s"]) + (" LATE" if t["late"] else "")
              if t["ago_s"] is not None else ("LATE" if t["late"] else "-"),
              f"{t['took_ms']} ms" if t["took_ms"] is not None else None,
              (f"a tick running for {human_duration(time.time() - t['running_since'])}; "
               if t.get("running_since") else "")
              + (f"last tick FAILED {human_duration(time.time() - t['last_failure']['at'])} "
                 "ago (verdict below); " if t.get("last_failure") else "")
              + (", ".join(f"{k}={v}" for k, v in t["counts"].items() if v) or "nothing")]
             for t in report["sweeps"]])))
    broker = report.get("broker")
    if broker:
        beat_at = report["beat"]["last_tick_at"]
        typer.echo("beat: " + (f"last tick {human_duration(time.time() - beat_at)} ago"
                               if beat_at else "NOT RUNNING"))
        if "workers" in report:  # not asked when Redis failed first (a full one, say)
            typer.echo(f"workers online: {', '.join(report['workers']) or 'NONE'}")
        if "lanes" in report:
            typer.echo("lanes")
            typer.echo(_indent(table(["lane", "queue", "waiting", "workers"],
                                     [[row["lane"], row["queue"], row["waiting"],
                                       ", ".join(row["workers"]) or "NONE"]
                                      for row in report["lanes"]])))
        typer.echo(f"queues: {broker['queued']} waiting in all (lanes above); "
                   f"{broker['unacked']} delivered and not yet acknowledged")
    verdict = report["verdict"]
    typer.echo("verdict: ok" if verdict["ok"] else "verdict: NEEDS A PERSON")
    for problem in verdict["problems"]:
        typer.echo(f"  - {problem}")
    for note in verdict["notes"]:
        typer.echo(f"  note: {note}")


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def health(
    worker: Annotated[bool, typer.Option("--worker", help="A worker answers a ping.")] = False,
    beat: Annotated[bool, typer.Option("--beat", help="Beat ticked recently.")] = False,
    store: Annotated[bool, typer.Option("--store", help="The store is reachable, "
                                                        "migrated and writable.")] = False,
    broker: Annotated[bool, typer.Option("--broker", help="Redis answers.")] = False,
    node: Annotated[str | None, typer.Option(help="With --worker: this worker node "
                                                  "(e.g. leasekeeper@$HOSTNAME).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait "
                                                                        "for a worker.")] = 2.0,
) -> None:
    """Probe the backend: silent with exit 0 when healthy; one line per failure and exit 1.
    Without a flag, every check."""
    settings = get_settings()
    chosen = [c for c, on in ((Check.BROKER, broker), (Check.STORE, store),
                              (Check.WORKER, worker), (Check.BEAT, beat)) if on] or list(Check)
    failures = [f"{check}: {problem}" for check in chosen
                for problem in _probe(check, settings, node, timeout_s)]
    for failure in failures:
        typer.echo(f"unhealthy {failure}", err=True)
    raise typer.Exit(ExitCode.NEEDS_ATTENTION if failures else ExitCode.OK)


def _probe(check: Check, settings: Settings, node: str | None, timeout_s: float
           ) -> list[str]:
    """What the check finds wrong (nothing: healthy)."""
    from workers.preflight import check_broker, check_store, check_store_writable

    try:
        match check:
            case Check.BROKER:
                check_broker(settings.effective_broker_url)
            case Check.STORE:
                check_store(settings.effective_store_url)
                check_store_writable(settings.effective_store_url)
            case Check.WORKER:
                return _probe_workers(settings, node, timeout_s)
            case Check.BEAT:
                from workers.beat import beat_stale_after_s
                from workers.heartbeats import last_beat

                check_broker(settings.effective_broker_url)
                client = _redis(settings)
                try:
                    at = last_beat(client, settings.task_queue)
                finally:
                    client.close()
                limit = beat_stale_after_s(settings)
                if at is None or time.time() - at > limit:
                    return [f"beat has not ticked within {limit:g} s (no mark at "
                            f"leasekeeper:{settings.task_queue}:beat)"]
    except LeasekeeperError as exc:
        return [exc.outside_a_task()]
    return []


def _probe_workers(settings: Settings, node: str | None, timeout_s: float) -> list[str]:
    """A worker of this installation answers and, unless ``node`` names the one to probe
    (a probe of that worker, not of the deploy), every lane with tasks waiting has one."""
    from tasks.broker_words import broker_unreachable
    from workers.cli_lanes import lane_rows, lanes_online, unserved
    from workers.preflight import check_broker

    check_broker(settings.effective_broker_url)
    served = lanes_online(timeout_s, settings.task_queue, node)
    if not served:
        return [no_worker(node, settings.task_queue)]
    if node:
        return []
    client = _redis(settings)
    try:
        return unserved(lane_rows(client, settings.task_queue, served))
    except redis.RedisError as exc:
        return [broker_unreachable(settings.effective_broker_url, exc)
                .replace("; nothing was sent.", ".")]
    finally:
        client.close()
