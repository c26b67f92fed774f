"""`leasekeeper`, the operator's command line: the root app and the list of its commands.

Each command group lives in its own module and is registered here, so adding one is a new
module plus one line below:

    up, flower                 workers/cli_up.py      the embedded backend; Flower with auth
    db upgrade                 workers/cli_db.py      the store's migrations
    leases list|show|destroy|retry|forget   workers/cli_leases.py
    runs list|show             workers/cli_runs.py
    status, health             workers/cli_status.py  one-screen status; probes
    reap                       workers/cli_reap.py    every sweep once, or a dry run
    pools                      workers/cli_pools.py   the warm pools, their members, breakers
    check, metrics, console    workers/cli_observe.py invariants; the exporter; the console

Errors leasekeeper raises on purpose become one line on stderr and exit code 2 (main below);
the exit codes every command uses are in workers/cli_common.py.
"""

from __future__ import annotations

from typing import Annotated

import typer

from workers import (
    cli_db,
    cli_leases,
    cli_observe,
    cli_pools,
    cli_reap,
    cli_runs,
    cli_status,
    cli_up,
)
from workers.cli_common import run_cli

cli = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                  help="leasekeeper: the operator's command line for sandbox leases.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"leasekeeper {version('leasekeeper')}")
        raise typer.Exit(0)


@cli.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """leasekeeper: the operator's command line for sandbox leases."""


cli_up.register(cli)
cli_db.register(cli)
cli_leases.register(cli)
cli_runs.register(cli)
cli_status.register(cli)
cli_reap.register(cli)
cli_pools.register(cli)
cli_observe.register(cli)


def main() -> None:
    run_cli(cli)


if __name__ == "__main__":
    main()
