"""`leasekeeper runs list|show`: the runs the store knows, newest first, and one run with
its lease."""

from __future__ import annotations

from typing import Annotated

import typer

from models.reports import run_page
from models.schema import RunStatus, utcnow
from providers.errors import NotFound
from workers.cli_common import (
    age,
    check_id_argument,
    check_option_id,
    emit_json,
    iso,
    not_empty,
    page_footer,
    page_json,
    runtime,
    show_fields,
    table,
)
from workers.cli_leases import BeforeOpt, JsonOpt, LimitOpt, lease_json, run_json

runs_cli = typer.Typer(no_args_is_help=True, help="Inspect runs.")
STATUSES = [s.value for s in RunStatus]


def register(cli: typer.Typer) -> None:
    cli.add_typer(runs_cli, name="runs")


@runs_cli.command("list")
def runs_list(
    status: Annotated[list[str] | None, typer.Option(
        callback=not_empty,
        help=f"Only runs with this status (repeatable): {', '.join(STATUSES)}.")] = None,
    thread: Annotated[str | None, typer.Option(callback=not_empty,
                                               help="Only runs of this thread.")] = None,
    limit: LimitOpt = 50, before: BeforeOpt = None, as_json: JsonOpt = False,
) -> None:
    """List runs, newest first, a page at a time (--before for the next page)."""
    unknown = sorted(set(status or []) - set(STATUSES))
    if unknown:
        raise typer.BadParameter(f"unknown status(es) {', '.join(unknown)}; known: "
                                 f"{', '.join(STATUSES)}", param_hint="--status")
    if before is not None:
        check_option_id("--before", before)
    page = run_page(runtime().store, tuple(status or ()), thread, limit, before)
    if as_json:
        emit_json(page_json("runs", [run_json(r) for r in page.rows], page))
        return
    now = utcnow()
    typer.echo(table(["run", "status", "exit", "thread", "provider", "lease", "started", "age",
                      "detached since", "reclaim"],
                     [[r.run_id, r.status, r.exit_code, r.thread_id, r.provider, r.lease_id,
                       r.started_at, age(r.started_at, now), r.detached_since,
                       r.reclaim_outcome] for r in page.rows]))
    typer.echo(page_footer(page, "run(s)"))


@runs_cli.command("show")
def runs_show(run_id: str, as_json: JsonOpt = False) -> None:
    """A run's fields and its lease."""
    rt = runtime()
    check_id_argument("run id", run_id, "`leasekeeper runs list` shows them")
    run = rt.store.get_run(run_id)
    if run is None:
        if rt.store.find_lease(run_id) is not None:
            raise NotFound(f"no run {run_id!r} in the store; {run_id!r} is a lease: "
                           f"`leasekeeper leases show {run_id}`")
        raise NotFound(f"no run {run_id!r} in the store; `leasekeeper runs list` shows them")
    lease = rt.store.find_lease(run.lease_id) if run.lease_id else None
    if as_json:
        emit_json({"run": run_json(run), "lease": lease_json(lease) if lease else None})
        return
    fields = [("run", run.run_id), ("status", run.status), ("exit code", run.exit_code),
              ("error", run.error), ("thread", run.thread_id), ("provider", run.provider),
              ("lease", f"{run.lease_id} ({lease.state}"
                        f"{', ' + lease.end_reason if lease.end_reason else ''})"
                        if lease else run.lease_id),
              ("sandbox key", run.sandbox_key), ("started", iso(run.started_at)),
              ("finished", iso(run.finished_at)), ("detached since", iso(run.detached_since)),
              ("cancel requested", run.cancel_requested),
              ("reclaim", run.reclaim_outcome), ("reclaimed", iso(run.reclaimed_at))]
    typer.echo(show_fields(fields))
