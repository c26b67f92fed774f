"""`leasekeeper check|metrics|console`: the store's invariants, the Prometheus exporter and
the lease console (the last two are long-running servers; see workers/metrics/ and
workers/console/)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from models.schema import utcnow
from workers.cli_common import ExitCode, runtime
from workers.settings import get_settings


def register(cli: typer.Typer) -> None:
    cli.command()(check)
    cli.command()(metrics)
    cli.command()(console)


def check(
    as_json: Annotated[bool, typer.Option("--json", help="Print the violations as JSON")] = False,
) -> None:
    """Check the store's invariants (models/invariants.py); exit 1 on any violation."""
    from models.invariants import check as check_store

    rt = runtime()
    violations = check_store(rt.store, utcnow(), rt.settings.claim_timeout_s,
                             {pool.name: pool.max_size for pool in rt.settings.pools},
                             rt.settings.leaseless_run_grace_s)
    if as_json:
        typer.echo(json.dumps({"violations": [v.as_dict() for v in violations]}, indent=1))
    else:
        for violation in violations:
            typer.echo(violation.describe())
        typer.echo(f"{len(violations)} violation(s)" if violations else "no violations")
    raise typer.Exit(ExitCode.NEEDS_ATTENTION if violations else ExitCode.OK)


def metrics() -> None:
    """Serve Prometheus metrics on LEASEKEEPER_METRICS_HOST:LEASEKEEPER_METRICS_PORT."""
    from workers.metrics.server import serve

    serve(get_settings(), typer.echo)


def console() -> None:
    """Serve the lease console on LEASEKEEPER_CONSOLE_HOST:LEASEKEEPER_CONSOLE_PORT."""
    from workers.console.server import serve

    serve(get_settings(), typer.echo)
