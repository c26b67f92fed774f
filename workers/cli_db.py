"""`leasekeeper db`: the store's schema. `upgrade` applies migrations, `current` says where
the store is against this leasekeeper, `downgrade` undoes migrations (rolling a release
back: run it with the release that made them, before starting the older one)."""

from __future__ import annotations

from typing import Annotated

import typer

from workers.cli_common import ExitCode, emit_json, error_line
from workers.cli_leases import JsonOpt
from workers.settings import Settings, get_settings

db_cli = typer.Typer(no_args_is_help=True, help="The lease store's schema.")


def register(cli: typer.Typer) -> None:
    cli.add_typer(db_cli, name="db")


@db_cli.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations to LEASEKEEPER_STORE_URL (default: SQLite in LEASEKEEPER_VAR_DIR)."""
    from workers.db_revisions import reached
    from workers.preflight import migrate, shown

    url = get_settings().effective_store_url
    migrate(url, revision)
    typer.echo(f"store {shown(url)} {reached(url, revision)}")


@db_cli.command("current")
def db_current(as_json: JsonOpt = False) -> None:
    """The store's migration against this leasekeeper's latest. Exit 0 when they match, 1
    when the store needs `leasekeeper db upgrade` or a newer leasekeeper migrated it."""
    from workers.db_revisions import SchemaPosition, schema_position
    from workers.preflight import check_driver, shown, sqlite_store_file

    url = get_settings().effective_store_url
    check_driver(url)
    path = sqlite_store_file(url)
    where = schema_position(url)
    absent = f"there is no store at {path}, " if path is not None and not path.is_file() else ""
    if as_json:
        emit_json({"store": shown(url), "exists": not absent,
                   "position": where.position.value, "current": list(where.current),
                   "latest": list(where.heads), "pending": list(where.pending),
                   "message": f"{absent}{where.describe()}"})
    else:
        typer.echo(f"store {shown(url)}: {absent}{where.describe()}")
    raise typer.Exit(ExitCode.OK if where.position == SchemaPosition.AT_HEAD
                     else ExitCode.NEEDS_ATTENTION)


@db_cli.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(
        help="The migration to go back to (as `leasekeeper db current` and the migrations "
             "folder name them), or `base` for an empty store.")],
    yes: Annotated[bool, typer.Option(
        "--yes", help="Really undo them: what they added (tables, columns, indexes) is "
                      "dropped, with its data.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Undo them even while workers or beat of this installation answer "
                        "on the broker.")] = False,
) -> None:
    """Undo migrations down to REVISION. Stop every worker, beat, exporter and console of
    this store first (a worker or beat still answering on the broker refuses it, unless
    --force); without --yes, only says what would be undone."""
    from models.downgrade_guard import WouldStrand, refusal
    from workers.db_revisions import plan_downgrade, run_downgrade, stranding
    from workers.preflight import shown

    settings = get_settings()
    url = settings.effective_store_url
    plan = plan_downgrade(url, revision)
    if not plan.undone:
        typer.echo(f"store {shown(url)} is already at {plan.target}: nothing to undo")
        return
    listing = ", ".join(plan.undone)
    stranded = stranding(url, plan.target)
    if not yes:
        typer.echo(f"would undo on store {shown(url)}: {listing} (dropping what they added, "
                   "with its data); stop every leasekeeper process on this store, then run "
                   "again with --yes")
        if stranded:  # --yes would refuse it now: say so, and what to do first
            error_line(f"refused as things stand: {refusal(stranded)}")
        raise typer.Exit(ExitCode.NEEDS_ATTENTION)
    if stranded:
        error_line(str(refusal(stranded)))
        raise typer.Exit(ExitCode.NEEDS_ATTENTION)
    running = [] if force else _running(settings)
    if running:
        error_line(f"not undone: {', '.join(running)} of this installation running on the "
                   f"broker; their next statements would fail on a schema taken from under "
                   "them. Stop every leasekeeper process on this store, then run the "
                   "downgrade again (--force to do it anyway)")
        raise typer.Exit(ExitCode.NEEDS_ATTENTION)
    try:
        run_downgrade(url, plan.target)
    except WouldStrand as exc:  # a lease went live since the look above
        error_line(str(exc))
        raise typer.Exit(ExitCode.NEEDS_ATTENTION) from None
    typer.echo(f"store {shown(url)} is at {plan.target} (undone: {listing})")


def _running(settings: Settings) -> list[str]:
    """What of this installation answers on its broker now: its workers (by the queues they
    consume) and beat (its liveness mark, fresh as `health --beat` judges it: a beat stopped
    cleanly clears it, a killed one's goes stale). A broker that cannot be reached tells
    nothing; the README's order (stop them first) is then the only guard."""
    import time

    import redis

    from providers.errors import LeasekeeperError
    from workers.beat import beat_stale_after_s
    from workers.cli_common import human_duration
    from workers.cli_lanes import lanes_online
    from workers.heartbeats import last_beat
    from workers.preflight import check_broker

    broker = settings.effective_broker_url
    try:
        check_broker(broker)
    except LeasekeeperError:
        return []
    running = []
    workers = lanes_online(1.0, settings.task_queue)
    if workers:
        running.append(f"{len(workers)} worker(s) ({', '.join(sorted(workers))})")
    client = redis.Redis.from_url(broker, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        at = last_beat(client, settings.task_queue)
        if at is not None and time.time() - at <= beat_stale_after_s(settings):
            running.append(f"beat (last ticked {human_duration(time.time() - at)} ago)")
    except redis.RedisError:
        pass
    finally:
        client.close()
    return running
