"""`leasekeeper pools`: each warm pool as the store sees it now, beside its declaration.

One row per declared pool, plus any pool no longer declared whose members still exist
(they are being drained): size and max_size (declared), its unclaimed members by state
(warm, provisioning, draining = pending_cleanup or destroying), and its circuit breaker
(closed, open until a time, or half open: one probe member at a time) with the last
error, and whether that error is the provider refusing the pool's template (then it can
create nothing until the template changes). `leasekeeper status` shows the same rows in
short.
"""

from __future__ import annotations

from typing import Any

import typer

from models.pool_store import Breaker, PoolStore
from models.schema import LeaseState, utcnow
from workers.cli_common import ExitCode, emit_json, iso, runtime, table
from workers.cli_leases import JsonOpt
from workers.runtime import Runtime


def register(cli: typer.Typer) -> None:
    cli.command("pools")(pools)


def pool_rows(rt: Runtime) -> list[dict[str, Any]]:
    """What `leasekeeper pools` and `leasekeeper status` show, pool by pool."""
    declared = {p.name: p for p in rt.settings.pools}
    store = PoolStore(rt.store)
    breakers = store.breakers()
    names = sorted(set(declared) | set(breakers))
    counts = store.member_counts(names)
    now, threshold = utcnow(), rt.settings.pool_breaker_threshold
    rows = []
    for name in names:
        pool, members = declared.get(name), counts[name]
        if pool is None and not any(members.values()):
            continue  # removed long ago, nothing left of it
        breaker = breakers.get(name) or Breaker(name)
        rows.append({
            "pool": name, "declared": pool is not None,
            "provider": pool.provider if pool else None,
            "size": pool.size if pool else 0, "max_size": pool.max_size if pool else 0,
            "warm": members[LeaseState.WARM],
            "provisioning": members[LeaseState.PROVISIONING],
            "draining": members[LeaseState.PENDING_CLEANUP] + members[LeaseState.DESTROYING],
            "breaker": breaker.state(threshold, now).value,
            "open_until": breaker.open_until if breaker.open_until
            and breaker.open_until > now else None,
            "consecutive_failures": breaker.consecutive_failures,
            "failures_total": breaker.failures_total, "last_error": breaker.last_error,
            "template_refused": breaker.refused})
    return rows


def pools(as_json: JsonOpt = False) -> None:
    """Each warm pool: its size, its members by state, its circuit breaker."""
    rows = pool_rows(runtime())
    if as_json:
        emit_json({"pools": rows})
        raise typer.Exit(ExitCode.OK)
    if not rows:
        typer.echo("no warm pools (declare them in LEASEKEEPER_POOLS or "
                   "LEASEKEEPER_POOLS_FILE)")
        raise typer.Exit(ExitCode.OK)
    typer.echo(table(
        ["pool", "provider", "size", "max", "warm", "provisioning", "draining", "breaker",
         "failures", "last error"],
        [[r["pool"] + ("" if r["declared"] else " (removed)"), r["provider"], r["size"],
          r["max_size"], r["warm"], r["provisioning"], r["draining"],
          r["breaker"] + (f" until {iso(r['open_until'])}" if r["open_until"] else ""),
          f"{r['consecutive_failures']} in a row, {r['failures_total']} in all",
          (r["last_error"] or "")[:80]] for r in rows]))
