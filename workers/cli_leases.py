"""`leasekeeper leases list|show|retry|forget`: inspect leases, act on abandoned ones."""

from __future__ import annotations

from typing import Annotated

import typer

from models.schema import LeaseState, utcnow
from workers.cli_common import runtime

leases_cli = typer.Typer(no_args_is_help=True,
                         help="Inspect leases; destroy, retry or forget them.")


def register(cli: typer.Typer) -> None:
    cli.add_typer(leases_cli, name="leases")


@leases_cli.command("list")
def leases_list(state: Annotated[list[str] | None, typer.Option()] = None) -> None:
    """List leases (optionally only some states)."""
    for lease in runtime().store.leases(state):
        typer.echo(f"{lease.lease_id}  {lease.state:<16} {lease.provider:<10} "
                   f"{lease.provider_lease_id:<36} run={lease.run_id} "
                   f"attempts={lease.cleanup_attempts} {lease.last_error or ''}")


@leases_cli.command("show")
def leases_show(lease_id: str) -> None:
    """A lease and its whole history."""
    rt = runtime()
    lease = rt.store.get_lease(lease_id)
    typer.echo(f"{lease.lease_id} {lease.state} ({lease.provider} {lease.provider_lease_id})")
    for e in rt.store.events(lease_id):
        typer.echo(f"  {e.at.isoformat()}Z {e.from_state or '-':>15} → {e.to_state:<15} "
                   f"{e.reason}  [task {e.task_id}]")


@leases_cli.command("retry")
def leases_retry(lease_id: str) -> None:
    """Give an abandoned lease a fresh set of cleanup attempts."""
    moved = runtime().store.transition(
        lease_id, {LeaseState.ABANDONED}, LeaseState.PENDING_CLEANUP,
        "operator: retry cleanup", cleanup_attempts=0, next_cleanup_at=utcnow())
    typer.echo("queued for sweep.retry_cleanup" if moved else "only abandoned leases retry")
    raise typer.Exit(0 if moved else 1)


@leases_cli.command("forget")
def leases_forget(lease_id: str, reason: Annotated[str, typer.Option()] = "by operator") -> None:
    """Mark an abandoned lease destroyed: the operator removed it by hand. (If it is in
    fact still there, sweep.orphans finds it and cleans it up with fresh attempts.)"""
    moved = runtime().store.transition(
        lease_id, {LeaseState.ABANDONED}, LeaseState.DESTROYED,
        f"operator: forgotten ({reason})", end_reason="forgotten", cleanup_attempts=0)
    typer.echo("forgotten" if moved else "only abandoned leases can be forgotten")
    raise typer.Exit(0 if moved else 1)
