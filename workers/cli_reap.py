"""`leasekeeper reap [--dry-run] [--sweep NAME]`: every sweep once, as a beat tick would."""

from __future__ import annotations

from typing import Annotated

import typer

from workers.cli_common import emit_json, runtime
from workers.cli_leases import JsonOpt


def register(cli: typer.Typer) -> None:
    cli.command()(reap)


def reap(
    dry_run: Annotated[bool, typer.Option(help="Only show what each sweep would do now")] = False,
    sweep: Annotated[list[str] | None, typer.Option(help="Only this sweep (repeatable)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run every sweep once, as a beat tick would; with --dry-run, change nothing."""
    from tasks.reap import SWEEPS, reap_once

    unknown = sorted(set(sweep or []) - set(SWEEPS))
    if unknown:
        raise typer.BadParameter(f"unknown sweep(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(SWEEPS)}", param_hint="--sweep")
    summaries = reap_once(runtime(), dry_run, sweep)
    if as_json:  # each sweep's summary as its tick logs it: counts, ids, how long it took
        emit_json({"dry_run": dry_run, "sweeps": list(summaries)})
        return
    for summary in summaries:
        counts = {k: v for k, v in summary.items()
                  if k not in {"sweep", "run", "took_ms", "items"} and v}
        verb = "would do" if dry_run else "did"
        typer.echo(f"{summary['sweep']} ({summary['run']}, {summary['took_ms']} ms): "
                   + (", ".join(f"{k}={v}" for k, v in counts.items()) or f"{verb} nothing"))
        for item in summary.get("items", []):
            typer.echo(f"  {'would: ' if dry_run else ''}{item}")
