"""`leasekeeper runs list|show`: the runs the store knows, newest first."""

from __future__ import annotations

import typer

runs_cli = typer.Typer(no_args_is_help=True, help="Inspect runs.")


def register(cli: typer.Typer) -> None:
    cli.add_typer(runs_cli, name="runs")
