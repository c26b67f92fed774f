"""`leasekeeper up`: the whole backend on embedded defaults (workers/embedded.py), with an
optional demo (workers/demo.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Annotated, Any

import typer

from providers.errors import LeasekeeperError
from workers.settings import get_settings


def register(cli: typer.Typer) -> None:
    cli.command()(up)


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


def _wait_for_worker(app: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if app.control.ping(timeout=0.5):
            return
    raise LeasekeeperError("the worker did not answer within 60 s; see its log")
