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
    from sqlalchemy.exc import SQLAlchemyError

    from models.migrate import upgrade
    from providers.errors import StoreUnavailable
    from workers.preflight import check_driver, shown

    url = get_settings().effective_store_url
    check_driver(url)
    try:
        upgrade(url, revision)
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        raise StoreUnavailable(
            f"cannot migrate the store {shown(url)} (LEASEKEEPER_STORE_URL): "
            f"{type(orig).__name__}: {str(orig).strip().splitlines()[0][:200]}") from None
    typer.echo(f"store {shown(url)} is at {revision}")
