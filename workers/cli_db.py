"""`leasekeeper db upgrade`: apply the store's migrations."""

from __future__ import annotations

import typer

from workers.settings import get_settings

db_cli = typer.Typer(no_args_is_help=True, help="The lease store's schema.")


def register(cli: typer.Typer) -> None:
    cli.add_typer(db_cli, name="db")


@db_cli.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations to LEASEKEEPER_STORE_URL (default: SQLite in LEASEKEEPER_VAR_DIR)."""
    from workers.preflight import migrate, shown

    url = get_settings().effective_store_url
    migrate(url, revision)
    typer.echo(f"store {shown(url)} is at {revision}")
