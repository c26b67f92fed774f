"""`leasekeeper up`: the whole backend on embedded defaults (workers/embedded.py), with an
optional demo (workers/demo.py); and `leasekeeper flower`, Flower that never runs without
basic auth.

`up` writes the settings a client needs (broker, store, and the other settings it was
started with, never a secret) to ``$LEASEKEEPER_VAR_DIR/env``
(default ``.var/env``), which the CLI and the producer read when run from the same
directory, prints the same lines to paste, and removes the file when it stops.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Collection, Mapping
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from models.shown_url import has_password, shown_url
from providers.errors import ConfigError, LeasekeeperError
from workers.cli_common import command_name
from workers.flower_auth import GENERATED
from workers.preflight import shown
from workers.settings import (
    ENV_PREFIX,
    Settings,
    env_file_path,
    get_settings,
    load_settings,
)

# Short sweep intervals and detach TTL so the demo shows reaping within seconds. Only the
# demo runs with them: afterwards worker and beat restart on the normal settings.
DEMO_SETTINGS = {"REAP_RUNS_INTERVAL_S": "1", "EXPIRE_LEASES_INTERVAL_S": "1",
                 "RETRY_CLEANUP_INTERVAL_S": "2", "RUN_DETACH_TTL_S": "2",
                 "FINISH_EXITED_INTERVAL_S": "1", "ORPHANS_INTERVAL_S": "2",
                 "STUCK_PROVISIONING_INTERVAL_S": "2", "FILL_POOLS_INTERVAL_S": "1",
                 "LOCAL_DESTROY_GRACE_S": "2"}
# Never in the env file or the lines to paste, whatever the setting: a name that says it
# is a credential (LEASEKEEPER_FLOWER_BASIC_AUTH, LEASEKEEPER_SECRET_MARKS_KEY, ...).
SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "AUTH", "KEY")
# Settings only up's own children use: each child gets its own log file from up.
NOT_FOR_CLIENTS = frozenset({"LEASEKEEPER_LOG_FILE"})
# Paths a client elsewhere must read as up did (relative to up's working directory).
PATH_SETTINGS = frozenset({"LEASEKEEPER_POOLS_FILE", "LEASEKEEPER_FAULTS_FILE",
                           "LEASEKEEPER_KUBE_CONFIG_PATH"})


def register(cli: typer.Typer) -> None:
    cli.command()(up)
    cli.command()(flower)


def say(line: str) -> None:
    # After SIGHUP the terminal is gone: a line that cannot be written must not cut the
    # stopping short.
    with contextlib.suppress(OSError):
        typer.echo(f"{datetime.now():%H:%M:%S} {line}")


class StopSignals:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP (the terminal closed) all stop `up` the same way.

    While starting or during the demo the first one interrupts (KeyboardInterrupt); while
    `up` waits, it only sets ``stop``. Any later one is ignored, so a second Ctrl-C cannot
    cut the stopping of the children short. Installed first, so a shell that made the
    process ignore SIGINT cannot keep Ctrl-C from stopping it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.interrupting = True

    def install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self._received)

    def _received(self, signum: int, _frame: object) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        if self.interrupting:
            raise KeyboardInterrupt


def up(
    demo: Annotated[int, typer.Option(min=0, max=100,
                                      help="Drive N demo runs through the producer API")] = 0,
    exit_after_demo: Annotated[bool, typer.Option(help="Stop once the demo is checked")] = False,
) -> None:
    """Bring up Redis (unless LEASEKEEPER_BROKER_URL is set), a worker, beat and Flower."""
    from workers.up_lock import hold_var_dir

    if exit_after_demo and not demo:  # else ignored, and up would run until Ctrl-C
        raise typer.BadParameter("--exit-after-demo needs --demo N (N >= 1): add --demo N, "
                                 "or drop --exit-after-demo to keep up running",
                                 param_hint="--exit-after-demo")
    signals = StopSignals()
    signals.install()
    settings = load_settings(read_env_file=False)  # a stale env file must not steer `up`
    try:
        with hold_var_dir(settings.var_dir):  # one `up` per var dir, before touching it
            ok = _up(settings, demo, exit_after_demo, signals)
    except KeyboardInterrupt:
        say("interrupted while starting; everything it started is stopped")
        raise typer.Exit(130) from None
    say("stopped")
    raise typer.Exit(0 if ok else 1)


def _up(settings: Settings, demo: int, exit_after_demo: bool, signals: StopSignals) -> bool:
    """Run the backend until a stop signal (or the demo's end); True if all went well."""
    from workers.embedded import embedded_backend

    env_file = env_file_path()
    env_file.unlink(missing_ok=True)
    demo_env = {f"LEASEKEEPER_{k}": v for k, v in DEMO_SETTINGS.items()
                if f"LEASEKEEPER_{k}" not in os.environ} if demo else {}  # yours win
    say("starting " + ("Redis, " if not settings.broker_url else "")
        + "the store, a worker, beat, Flower, the metrics exporter and the lease console ...")
    try:
        with embedded_backend(settings, demo_env,
                              lambda name, took: say(f"  {name} ready ({took:.1f} s)"),
                              say) as backend:
            os.environ.update({k: v for k, v in backend.env.items()
                               if k.startswith("LEASEKEEPER_")})
            get_settings.cache_clear()
            client_env = _client_env(get_settings(), os.environ, demo_env)
            _write_env_file(env_file, client_env)
            _banner(settings, backend.flower_url, backend.flower_auth, backend.logdir,
                    backend.notes, env_file, client_env, backend.metrics_url,
                    backend.console_url)
            ok = True
            if demo:
                outcome = _demo(demo)
                if outcome is DemoOutcome.INTERRUPTED:
                    _stopping(settings, backend)
                    return False
                ok = outcome is DemoOutcome.AS_EXPECTED
                if exit_after_demo:
                    return ok
                _end_demo(backend, demo_env)
            say("press Ctrl-C to stop")
            signals.interrupting = False
            ok = _watch(backend, signals.stop) and ok
            _stopping(settings, backend)
            return ok
    finally:
        env_file.unlink(missing_ok=True)


class DemoOutcome(StrEnum):
    AS_EXPECTED = "as-expected"
    NOT_AS_EXPECTED = "not-as-expected"
    INTERRUPTED = "interrupted"


def _demo(count: int) -> DemoOutcome:
    """Run the demo; interrupted (Ctrl-C, SIGTERM, SIGHUP), destroy the leases it made
    while the worker still runs, so they are not left behind with nobody to end them."""
    from workers.demo import run_demo
    from workers.runtime import get_runtime

    runs: list[str] = []
    try:
        ok = run_demo(get_runtime(), count, runs)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            typer.echo("")
        say("interrupted during the demo: destroying the leases it made ...")
        _destroy_demo_leases(runs)
        return DemoOutcome.INTERRUPTED
    say("demo: every lease reached its expected state" if ok
        else "demo: some leases did NOT reach their expected state")
    return DemoOutcome.AS_EXPECTED if ok else DemoOutcome.NOT_AS_EXPECTED


def _destroy_demo_leases(runs: list[str], wait_s: float | None = None) -> None:
    """Destroy every live lease of the demo's runs before the worker stops. An acquire
    still under way (its run not yet recorded, or its lease not yet written) is waited
    for and its lease destroyed too, and so is a destroy another task has under way (the
    demo's own reclaim: ``in_progress``); at most ``wait_s`` in all (DEMO_DESTROY_WAIT_S),
    then `_what_stays_running` names what is left."""
    from models.schema import LeaseState, RunStatus
    from tasks.destroy import DESTROYABLE
    from workers.runtime import get_runtime

    store = get_runtime().store
    deadline = time.monotonic() + (DEMO_DESTROY_WAIT_S if wait_s is None else wait_s)
    asked: dict[str, str] = {}  # lease id -> what its destroy answered
    while True:
        waiting: list[str] = []
        for run_id in runs:
            run = store.get_run(run_id)
            if run is None or run.lease_id is None:
                if run is None or run.status == RunStatus.RUNNING:
                    waiting.append(run_id)  # its acquire is under way
                continue
            lease = store.get_lease(run.lease_id)
            if lease.state in DESTROYABLE and lease.lease_id not in asked:
                asked[lease.lease_id] = _destroy_one(lease.lease_id)
                lease = store.get_lease(lease.lease_id)
            if lease.state in (LeaseState.PROVISIONING, LeaseState.DESTROYING):
                waiting.append(run_id)  # a destroy, or the acquire it ended, under way
            elif asked.get(lease.lease_id) == "in_progress":
                asked[lease.lease_id] = str(lease.state)
                say(f"  lease {lease.lease_id}: {lease.state}")
        if not waiting:
            return
        if time.monotonic() >= deadline:
            say(f"  still under way: the leases of run(s) {', '.join(waiting)} (the sweeps "
                "finish them when leasekeeper runs again)")
            return
        time.sleep(0.2)


DEMO_DESTROY_WAIT_S = 30.0


def _destroy_one(lease_id: str) -> str:
    """lease.destroy through the producer; what it answered (said), or "failed"."""
    from celery.exceptions import CeleryError

    from tasks import producer

    try:
        done = producer.destroy_lease(lease_id, reason="demo interrupted").get(60)
    except (LeasekeeperError, CeleryError, TimeoutError) as exc:
        say(f"  lease {lease_id}: could not destroy it ({type(exc).__name__}: {exc})")
        return "failed"
    say(f"  lease {lease_id}: {done['result']}")
    return str(done["result"])


def _stopping(settings: Settings, backend: object) -> None:
    """Worker and beat stop first: the worker's running tasks (a destroy, an acquire)
    finish (workers/embedded.py), so what `up` then says stays running is what does;
    the others stop when the backend's context ends."""
    from workers.embedded import Embedded

    assert isinstance(backend, Embedded)
    with contextlib.suppress(OSError):
        typer.echo("")
    say("stopping worker, beat, Flower, the metrics exporter, the lease console"
        + ("" if settings.broker_url else " and Redis") + " ...")
    backend.supervisor.stop(["worker", "beat"])
    _what_stays_running()


def _client_env(settings: Settings, environ: Mapping[str, str],
                skip: Collection[str] = ()) -> dict[str, str]:
    """What another shell needs to see this backend as `up` runs it: broker, store and
    queue, then every other setting `up` was started with (pools, sweep intervals,
    lifetimes: `status` and `pools` judge by them), but no secret, nothing only up's
    children use, and none of ``skip`` (the demo's temporary overrides)."""
    env = {"LEASEKEEPER_BROKER_URL": settings.effective_broker_url,
           "LEASEKEEPER_STORE_URL": settings.effective_store_url,
           "LEASEKEEPER_TASK_QUEUE": settings.task_queue}
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    for key in sorted(known & environ.keys()):
        if (key in env or key in skip or key in NOT_FOR_CLIENTS
                or any(word in key for word in SECRET_WORDS)):
            continue
        value = environ[key]
        env[key] = str(Path(value).resolve()) if key in PATH_SETTINGS and value else value
    return env


def _env_lines(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """``export K=V`` lines a shell and the env file reader (python-dotenv) both read back
    as V; the names of any value no quoting gives both (a quote and a backslash in it)."""
    from dotenv import dotenv_values

    lines, left_out = [], []
    for key, value in env.items():
        line = f"export {key}={shlex.quote(value)}\n"
        if dotenv_values(stream=io.StringIO(line)).get(key) == value:
            lines.append(line)
        else:
            left_out.append(key)
    return "".join(lines), left_out


def _write_env_file(path: Path, env: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    lines, left_out = _env_lines(env)
    path.write_text("# written by `leasekeeper up`; removed when it stops\n" + lines)
    for key in left_out:
        say(f"note: {key} is not in {path} (its value cannot be quoted for both a shell "
            "and the env file reader): set it in the other shell too")


def _banner(settings: Settings, flower_url: str, flower_auth: str, logdir: Path,
            notes: list[str], env_file: Path, client_env: dict[str, str],
            metrics_url: str = "", console_url: str = "") -> None:
    creds = settings.var_dir.resolve() / "flower-credentials"
    creds.touch(mode=0o600)
    creds.write_text(flower_auth + "\n")
    for note in notes:
        say(f"note: {note}")
    say(f"leasekeeper is up: broker {shown_url(client_env['LEASEKEEPER_BROKER_URL'])}"
        f", store {shown(client_env['LEASEKEEPER_STORE_URL'])}")
    if settings.flower_basic_auth is not None:
        how = f"from LEASEKEEPER_FLOWER_BASIC_AUTH, also in {creds}"
    else:
        how = (f"in {creds}; the password is kept in {creds.with_name(GENERATED)} for the "
               "next `up` here; set LEASEKEEPER_FLOWER_BASIC_AUTH to choose them")
    say(f"Flower: {flower_url} (basic auth user:password {how})")
    if metrics_url:
        say(f"metrics: {metrics_url}; lease console: {console_url} (the same basic auth)")
    say(f"logs: {logdir}")
    typer.echo(f"\n{client_hint(env_file, Path.cwd(), command_name())}\nElsewhere, paste:\n"
               + "".join(_paste_line(k, v, env_file) for k, v in client_env.items()))


def _paste_line(key: str, value: str, env_file: Path) -> str:
    """The line another shell pastes for one variable; a URL holding a password is never
    printed (the console is shared, scrolled back, recorded): the env file, mode 0600,
    has it whole."""
    if key.endswith("_URL") and has_password(value):
        return f"  # {key} holds a password: copy its line from {env_file}\n"
    return f"  export {key}={shlex.quote(value)}\n"


def client_hint(env_file: Path, cwd: Path, command: str) -> str:
    """How another shell finds this backend: clients read ``.var/env`` under their working
    directory, or ``$LEASEKEEPER_VAR_DIR/env``; a var dir elsewhere needs the variable."""
    found = f"`{command} status` and the producer find this backend through {env_file}."
    if env_file.resolve() == (cwd / ".var" / "env").resolve():
        return f"In another shell in {cwd}, {found}"
    var_dir = env_file.resolve().parent
    return (f"In another shell, `export LEASEKEEPER_VAR_DIR={var_dir}` first (in any "
            f"directory); then {found}")


def _end_demo(backend: object, demo_env: dict[str, str]) -> None:
    """Worker and beat go back to the normal sweep intervals and detach TTL."""
    from workers.embedded import Embedded, node_name

    assert isinstance(backend, Embedded)
    env = {k: v for k, v in backend.env.items() if k not in demo_env}
    for key in demo_env:
        os.environ.pop(key, None)
    get_settings.cache_clear()
    say("demo over: restarting worker and beat on the normal sweep intervals ...")
    backend.restart(["worker", "beat"], env, node_name(),
                    lambda name, took: say(f"  {name} ready ({took:.1f} s)"))
    normal = get_settings()
    say(f"sweeps back to their intervals: reap_runs {normal.reap_runs_interval_s:g} s, "
        f"expire_leases {normal.expire_leases_interval_s:g} s, finish_exited "
        f"{normal.finish_exited_interval_s:g} s, orphans {normal.orphans_interval_s:g} s; "
        f"detached runs are reaped after {normal.run_detach_ttl_s} s")


def _watch(backend: object, stop: threading.Event) -> bool:
    """Wait for Ctrl-C or SIGTERM; a child that exits meanwhile stops `up` (False), with
    the end of its log: a dead beat would otherwise leave every sweep silently stopped."""
    from workers.embedded import Embedded

    assert isinstance(backend, Embedded)
    sup = backend.supervisor
    while not stop.wait(0.5):
        name = sup.exited()
        if name is not None:
            code = sup.procs[name].returncode
            say(f"{name} exited with code {code}; stopping everything")
            typer.echo(sup.tails(name) or f"{sup.log(name)} is empty", err=True)
            return False
    return True


def _what_stays_running() -> None:
    """Leases are not ended by stopping leasekeeper: say which and how to end them."""
    from models.observe import WAITING_FOR_CLEANUP
    from models.schema import LeaseState
    from workers.runtime import get_runtime

    rt = get_runtime()
    live = rt.store.leases([LeaseState.PROVISIONING, LeaseState.WARM, LeaseState.ACTIVE,
                            LeaseState.PENDING_CLEANUP, LeaseState.DESTROYING])
    sandboxes = []
    for name in rt.settings.providers:
        with contextlib.suppress(LeasekeeperError, OSError):  # one that cannot list: silent
            sandboxes += [r.name for r in rt.provider(name).list_managed()
                          if r.meta.get("alive", True)]
    if not live and not sandboxes:
        say("no lease is live and no sandbox is running")
        return
    by_state: dict[str, int] = {}
    for lease in live:
        by_state[lease.state] = by_state.get(lease.state, 0) + 1
    counts = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items())) or "no"
    say(f"stays running after leasekeeper stops: {counts} lease(s) and "
        f"{len(sandboxes)} sandbox(es) ({', '.join(sandboxes) or 'none'}).")
    ending = sum(n for state, n in by_state.items() if state in WAITING_FOR_CLEANUP)
    if ending:
        say(f"{ending} lease(s) being destroyed: the cleanup sweep finishes their destroy "
            "when leasekeeper runs again")
    command = command_name()
    warm = [lease for lease in live if lease.state == LeaseState.WARM]
    if warm:
        # No run holds them, so nothing is kept for anyone; `--state active` leaves them.
        pools = ", ".join(sorted({lease.pool or "?" for lease in warm}))
        say(f"{len(warm)} warm pool member(s) of pool(s) {pools} "
            f"({', '.join(lease.lease_id for lease in warm)}): to end them, start "
            f"`{command} up` again and run `{command} leases destroy --state warm --yes` "
            "(a pool still declared in LEASEKEEPER_POOLS or LEASEKEEPER_POOLS_FILE fills again; "
            "start `up` without it, and sweep.fill_pools drains its members itself)")
    kept = len(live) - ending - len(warm)
    if kept or not live:
        held = f"{kept} live lease(s) kept so their runs can resume; " if live else ""
        say(f"{held}to end them, start `{command} up` again and run `{command} leases "
            f"destroy --state active --yes` (or `{command} leases destroy <lease id>`)")


def flower(
    port: Annotated[int | None, typer.Option(help="Port (default LEASEKEEPER_FLOWER_PORT, "
                                                  "5555)")] = None,
    address: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 exposes "
                                              "Flower to the network")] = "127.0.0.1",
) -> None:
    """Flower for this installation, with basic auth from LEASEKEEPER_FLOWER_BASIC_AUTH
    (user:password). Refuses to start without it. /metrics and /healthcheck answer without
    auth (Flower's own behaviour)."""
    settings = get_settings()
    if settings.flower_basic_auth is None:
        raise ConfigError("Flower never runs without basic auth: set "
                          "LEASEKEEPER_FLOWER_BASIC_AUTH=user:password")
    auth = settings.flower_basic_auth.get_secret_value()
    if any(":" not in pair or pair.startswith(":") or pair.endswith(":")
           for pair in auth.split(",")):
        raise ConfigError("LEASEKEEPER_FLOWER_BASIC_AUTH must be user:password (several "
                          "comma-separated); got something else")
    port = settings.flower_port if port is None else port
    if not 0 < port < 65536:
        raise ConfigError(f"Flower needs a port between 1 and 65535, got {port}")
    from workers.embedded import port_is_free, require_package
    from workers.preflight import refuse_a_broker_that_refuses_us

    # A refused password would give a dashboard with no worker and no task, for ever.
    refuse_a_broker_that_refuses_us("flower")
    require_package("flower", "flower>=2.0", "`leasekeeper flower`")
    if address in {"127.0.0.1", "0.0.0.0", "localhost"} and not port_is_free(port):  # noqa: S104
        raise ConfigError(f"port {port} is taken by another process (another Flower?): stop "
                          "it, or choose another with --port or LEASEKEEPER_FLOWER_PORT")
    env = {**os.environ, "FLOWER_BASIC_AUTH": auth}  # by environment: not in `ps`
    logs = ([f"--log_file_prefix={settings.log_file.resolve()}",  # tornado rotates it
             f"--log_file_max_size={settings.log_file_max_bytes}",
             f"--log_file_num_backups={settings.log_file_backups}"] if settings.log_file else [])
    os.execve(sys.executable, [sys.executable, "-m", "celery", "-A", "workers.app", "flower",  # noqa: S606
                               f"--port={port}", f"--address={address}", *logs], env)
