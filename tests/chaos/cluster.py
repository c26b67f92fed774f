"""A leasekeeper installation the chaos proof may break: its own Redis and PostgreSQL
(so restarting them touches no other test), several real Celery workers, two beats, and a
Celery client for its broker. Every process it starts, it stops by pid."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from celery import Celery

from models.store import Store
from tests.services import (
    PostgresServer,
    RedisServer,
    _as_postgres,
    _pg_bin,
    accepting_connections,
    start_redis,
    wait_for_port,
)
from tests.stack import REPO
from workers.runtime import Runtime
from workers.settings import Settings


@dataclass
class ChaosCluster:
    root: Path
    redis: RedisServer
    postgres: PostgresServer
    store_url: str
    env_overrides: dict[str, str]
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    node: int = 0
    attacks: dict[str, int] = field(default_factory=dict)
    attack_errors: list[str] = field(default_factory=list)  # attack steps that failed

    @property
    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        return {**base, "LEASEKEEPER_BROKER_URL": self.redis.url,
                "LEASEKEEPER_STORE_URL": self.store_url, "LEASEKEEPER_VAR_DIR": str(self.root),
                "LEASEKEEPER_LOCAL_ROOT_DIR": str(self.root / "sandboxes"),
                "LEASEKEEPER_FAULTS_FILE": str(self.root / "faults.json"),
                "PYTHONPATH": str(REPO), **self.env_overrides}

    def settings(self) -> Settings:
        return Settings(**{k.removeprefix("LEASEKEEPER_").lower(): v
                           for k, v in self.env.items() if k.startswith("LEASEKEEPER_")})

    def runtime(self) -> Runtime:
        return Runtime(settings=self.settings(), store=Store(self.store_url))

    def client(self) -> Celery:
        """A Celery client on this installation's broker, as a web backend would hold."""
        from workers.app import create_app  # not at import: conftests load before the
        # session's broker is configured, and workers.app builds its app on import

        app = create_app(self.settings())
        app.conf.broker_connection_retry_on_startup = True
        return app

    def count(self, attack: str) -> None:
        self.attacks[attack] = self.attacks.get(attack, 0) + 1

    # -- workers -----------------------------------------------------------------------
    def start_worker(self, client: Celery, concurrency: int = 3) -> subprocess.Popen[bytes]:
        self.node += 1
        hostname = f"chaos-{self.node}@test"
        with open(self.root / "workers.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P", "prefork",
                 "-c", str(concurrency), "-E", "-n", hostname, "--without-gossip",
                 "--without-mingle", "-l", "info"],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.workers.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited ({proc.returncode}); see workers.log")
            try:
                if client.control.ping(destination=[hostname], timeout=0.5):
                    return proc
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(f"worker {hostname} did not answer a ping in 60 s")

    def live_workers(self) -> list[subprocess.Popen[bytes]]:
        return [w for w in self.workers if w.poll() is None]

    def kill_worker(self, rng: random.Random) -> None:
        """SIGKILL a whole worker (parent and pool), as a crashed machine would."""
        victim = rng.choice(self.live_workers())
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        self.count("workers_sigkilled")

    def kill_pool_child(self, rng: random.Random) -> None:
        """SIGKILL one pool process of a live worker, mid-task or idle."""
        children = [pid for w in self.live_workers() for pid in _children(w.pid)]
        if children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(children), signal.SIGKILL)
            self.count("pool_processes_sigkilled")

    # -- services ----------------------------------------------------------------------
    def restart_redis(self, down_s: float) -> None:
        self.redis.stop()
        time.sleep(down_s)
        self.redis = start_redis(self.root / "redis", self.redis.port)
        self.count("broker_restarts")

    def store_outage(self, down_s: float) -> None:
        self.postgres.stop()
        time.sleep(down_s)
        workdir = self.postgres.datadir.parent
        with open(workdir / "postgres.log", "ab") as log:
            self.postgres.proc = subprocess.Popen(
                [_pg_bin("postgres"), "-D", str(self.postgres.datadir), "-p",
                 str(self.postgres.port), "-c", "listen_addresses=127.0.0.1",
                 "-c", f"unix_socket_directories={workdir}", "-c", "fsync=off",
                 "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, **_as_postgres())
        wait_for_port(self.postgres.port, 30, self.postgres.proc)
        accepting_connections(self.postgres)
        self.count("store_outages")

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _children(ppid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == ppid:
                found.append(int(entry.name))
    return found
