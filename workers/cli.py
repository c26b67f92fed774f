"""``leasekeeper``: the operator's command line.

    leasekeeper up [--demo N] [--exit-after-demo]   the whole backend on embedded defaults
    leasekeeper db upgrade                          apply the store's migrations
    leasekeeper reap [--dry-run] [--sweep NAME]     run every sweep once (or show what it would do)
    leasekeeper leases list|show|retry|forget       inspect leases, act on abandoned ones
    leasekeeper check [--json]                      check the store's invariants
    leasekeeper metrics                             the Prometheus exporter (/metrics)
    leasekeeper console                             the lease console (web, basic auth)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Annotated

import typer

from models.schema import utcnow
from providers.errors import LeasekeeperError
from workers.settings import get_settings

if TYPE_CHECKING:
    from workers.runtime import Runtime

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
db_cli = typer.Typer(no_args_is_help=True, help="The lease store's schema.")
leases_cli = typer.Typer(no_args_is_help=True, help="Inspect leases; retry or forget them.")
cli.add_typer(db_cli, name="db")
cli.add_typer(leases_cli, name="leases")


def _runtime() -> Runtime:
    from workers.runtime import get_runtime

    return get_runtime()


@db_cli.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations to LEASEKEEPER_STORE_URL (default: SQLite in LEASEKEEPER_VAR_DIR)."""
    from models.migrate import upgrade

    url = get_settings().effective_store_url
    upgrade(url, revision)
    typer.echo(f"store at {url.split('@')[-1]} is at {revision}")


@cli.command()
def up(
    demo: Annotated[int, typer.Option(help="Drive N demo runs through the producer API")] = 0,
    exit_after_demo: Annotated[bool, typer.Option(help="Stop once the demo is checked")] = False,
) -> None:
    """Bring up Redis (unless LEASEKEEPER_BROKER_URL is set), a worker, beat and Flower."""
    from workers.embedded import embedded_backend

    settings = get_settings()
    demo_env: dict[str, str] = {}
    if demo:  # short sweep intervals and detach TTL so the demo shows reaping in seconds
        for key, value in {"REAP_RUNS_INTERVAL_S": "1", "EXPIRE_LEASES_INTERVAL_S": "1",
                           "RETRY_CLEANUP_INTERVAL_S": "2", "RUN_DETACH_TTL_S": "2",
                           "FINISH_EXITED_INTERVAL_S": "1", "ORPHANS_INTERVAL_S": "2",
                           "STUCK_PROVISIONING_INTERVAL_S": "2",
                           "LOCAL_DESTROY_GRACE_S": "2"}.items():
            demo_env.setdefault(f"LEASEKEEPER_{key}", os.environ.get(f"LEASEKEEPER_{key}",
                                                                      value))
    with embedded_backend(settings, demo_env) as backend:
        os.environ.update({k: v for k, v in backend.env.items() if k.startswith("LEASEKEEPER_")})
        get_settings.cache_clear()
        from workers.app import app
        from workers.runtime import get_runtime

        _wait_for_worker(app)
        creds = settings.var_dir.resolve() / "flower-credentials"
        creds.touch(mode=0o600)
        creds.write_text(backend.flower_auth + "\n")
        typer.echo(f"leasekeeper is up: broker {os.environ['LEASEKEEPER_BROKER_URL']}, store "
                   f"{get_settings().effective_store_url}")
        typer.echo(f"Flower: {backend.flower_url} (basic auth user:password in {creds}; "
                   "set LEASEKEEPER_FLOWER_BASIC_AUTH to choose them)")
        typer.echo(f"metrics: {backend.metrics_url}; lease console: {backend.console_url} "
                   "(the same basic auth)")
        typer.echo(f"logs: {backend.logdir}")
        ok = True
        if demo:
            from workers.demo import run_demo

            ok = run_demo(get_runtime(), demo)
            typer.echo("demo: every lease reached its expected state" if ok
                       else "demo: some leases did NOT reach their expected state")
        if not (demo and exit_after_demo):
            typer.echo("press Ctrl-C to stop")
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
    raise typer.Exit(0 if ok else 1)


def _wait_for_worker(app) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if app.control.ping(timeout=0.5):
            return
    raise LeasekeeperError("the worker did not answer within 60 s; see its log")


@cli.command()
def reap(
    dry_run: Annotated[bool, typer.Option(help="Only show what each sweep would do now")] = False,
    sweep: Annotated[list[str] | None, typer.Option(help="Only this sweep (repeatable)")] = None,
) -> None:
    """Run every sweep once, as a beat tick would; with --dry-run, change nothing."""
    from tasks.reap import SWEEPS, reap_once

    unknown = sorted(set(sweep or []) - set(SWEEPS))
    if unknown:
        raise typer.BadParameter(f"unknown sweep(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(SWEEPS)}", param_hint="--sweep")
    for summary in reap_once(_runtime(), dry_run, sweep):
        counts = {k: v for k, v in summary.items()
                  if k not in {"sweep", "run", "took_ms", "items"} and v}
        verb = "would do" if dry_run else "did"
        typer.echo(f"{summary['sweep']} ({summary['run']}, {summary['took_ms']} ms): "
                   + (", ".join(f"{k}={v}" for k, v in counts.items()) or f"{verb} nothing"))
        for item in summary.get("items", []):
            typer.echo(f"  {'would: ' if dry_run else ''}{item}")


@leases_cli.command("list")
def leases_list(state: Annotated[list[str] | None, typer.Option()] = None) -> None:
    """List leases (optionally only some states)."""
    for lease in _runtime().store.leases(state):
        typer.echo(f"{lease.lease_id}  {lease.state:<16} {lease.provider:<10} "
                   f"{lease.provider_lease_id:<36} run={lease.run_id} "
                   f"attempts={lease.cleanup_attempts} {lease.last_error or ''}")


@leases_cli.command("show")
def leases_show(lease_id: str) -> None:
    """A lease and its whole history."""
    rt = _runtime()
    lease = rt.store.get_lease(lease_id)
    typer.echo(f"{lease.lease_id} {lease.state} ({lease.provider} {lease.provider_lease_id})")
    for e in rt.store.events(lease_id):
        typer.echo(f"  {e.at.isoformat()}Z {e.from_state or '-':>15} → {e.to_state:<15} "
                   f"{e.reason}  [task {e.task_id}]")


@leases_cli.command("retry")
def leases_retry(lease_id: str) -> None:
    """Give an abandoned lease a fresh set of cleanup attempts."""
    from tasks.operator import retry_abandoned

    moved = retry_abandoned(_runtime().store, lease_id)
    typer.echo("queued for sweep.retry_cleanup" if moved else "only abandoned leases retry")
    raise typer.Exit(0 if moved else 1)


@leases_cli.command("forget")
def leases_forget(lease_id: str, reason: Annotated[str, typer.Option()] = "by operator") -> None:
    """Mark an abandoned lease destroyed: the operator removed it by hand. (If it is in
    fact still there, sweep.orphans finds it and cleans it up with fresh attempts.)"""
    from tasks.operator import forget_abandoned

    moved = forget_abandoned(_runtime().store, lease_id, reason)
    typer.echo("forgotten" if moved else "only abandoned leases can be forgotten")
    raise typer.Exit(0 if moved else 1)


@cli.command()
def check(
    as_json: Annotated[bool, typer.Option("--json", help="Print the violations as JSON")] = False,
) -> None:
    """Check the store's invariants (models/invariants.py); exit 1 on any violation."""
    import json

    from models.invariants import check as check_store

    rt = _runtime()
    violations = check_store(rt.store, utcnow(), rt.settings.claim_timeout_s)
    if as_json:
        typer.echo(json.dumps({"violations": [v.as_dict() for v in violations]}, indent=1))
    else:
        for violation in violations:
            typer.echo(violation.describe())
        typer.echo(f"{len(violations)} violation(s)" if violations else "no violations")
    raise typer.Exit(1 if violations else 0)


@cli.command()
def metrics() -> None:
    """Serve Prometheus metrics on LEASEKEEPER_METRICS_HOST:LEASEKEEPER_METRICS_PORT."""
    from workers.metrics.server import serve

    serve(get_settings(), typer.echo)


@cli.command()
def console() -> None:
    """Serve the lease console on LEASEKEEPER_CONSOLE_HOST:LEASEKEEPER_CONSOLE_PORT."""
    from workers.console.server import serve

    serve(get_settings(), typer.echo)


def main() -> None:
    try:
        cli()
    except LeasekeeperError as exc:
        typer.echo(f"leasekeeper: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
