"""The test session's Docker engine and images: scripts/dockerd.sh's private dockerd (no
bridge, no iptables, every path under ~/.cache/leasekeeper/docker), started for the session
and stopped by its pid at the end, and the images the Docker tests use: the local Debian
base (debootstrap, cached), the services image standing in for Docker Hub's Redis and
PostgreSQL, and the leasekeeper image built from the project's Dockerfile by compose.

Where Docker cannot start (not root, no dockerd, no kernel support) the tests skip with
the reason; under CI (``CI=true``) that is a failure instead: these machines can run them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERD_SH = REPO / "scripts" / "dockerd.sh"
SERVICES_DIR = Path(__file__).resolve().parent / "services"
CACHE = Path(os.environ.get("LEASEKEEPER_CACHE_DIR", Path.home() / ".cache" / "leasekeeper"))


def unavailable(reason: str) -> None:
    """Skip (no Docker here), or fail under CI, where these tests must run."""
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"CI must run the Docker tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class DockerEngine:
    root: Path
    lock: IO[str]
    env: dict[str, str]

    @property
    def host(self) -> str:
        return f"unix://{self.root / 'docker.sock'}"

    def script(self, command: str, timeout_s: float = 600) -> str:
        done = subprocess.run(["bash", str(DOCKERD_SH), command], capture_output=True,
                              text=True, env=self.env, timeout=timeout_s, check=False)
        if done.returncode != 0:
            reason = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            unavailable(f"scripts/dockerd.sh {command}: {reason[0]}")
        return done.stdout.strip()

    def docker(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout_s, check=False)

    def image_exists(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag).returncode == 0

    def build(self, tag: str, context: Path, **args: str) -> str:
        """``docker build --network host`` (layer-cached; a no-op when nothing changed)."""
        flags = [f"--build-arg={k}={v}" for k, v in args.items()]
        done = self.docker("build", "--network", "host", "-q", *flags, "-t", tag, str(context))
        assert done.returncode == 0, f"docker build {context} failed:\n{done.stderr[-3000:]}"
        return tag

    def stop(self) -> None:
        self.docker("image", "prune", "-f")  # superseded builds; tagged images stay cached
        self.script("stop", timeout_s=60)
        self.lock.close()


@contextlib.contextmanager
def docker_engine() -> Iterator[DockerEngine]:
    """The engine under the shared cache dir (its images are the cache), or a private one
    when another test session holds that; stopped by pid when the session ends."""
    if os.geteuid() != 0:
        unavailable("the Docker engine needs root (dockerd); this session is not root")
    shared = CACHE / "docker"
    shared.mkdir(parents=True, exist_ok=True)
    lock = open(shared / "session.lock", "w")  # noqa: SIM115 - held for the whole session
    root = shared
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        root = Path(tempfile.mkdtemp(prefix="docker-", dir=CACHE))
    env = {**os.environ, "LEASEKEEPER_DOCKER_DIR": str(root), "DOCKER_BUILDKIT": "0",
           "DOCKER_HOST": f"unix://{root / 'docker.sock'}"}
    engine = DockerEngine(root=root, lock=lock, env=env)
    engine.script("start", timeout_s=60)
    try:
        yield engine
    finally:
        engine.stop()


def _tree_hash(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Images:
    base: str      # the local Debian base (the Dockerfile's BASE_IMAGE in the tests)
    services: str  # Redis and PostgreSQL for docker-compose.yml's redis/postgres services
    leasekeeper: str  # the project's Dockerfile, as docker-compose.yml builds it


def images(engine: DockerEngine, build_leasekeeper: Callable[[Images], None]) -> Images:
    """Every image the tests use; the services image builds while ``build_leasekeeper``
    (docker-compose build) runs, both on the cached base."""
    base = engine.script("base-image", timeout_s=900)
    services = f"leasekeeper-test/services:{_tree_hash(SERVICES_DIR)}-{base.rsplit(':', 1)[1]}"
    found = Images(base=base, services=services,
                   leasekeeper="leasekeeper-test/leasekeeper:latest")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        if not engine.image_exists(services):
            pending = pool.submit(engine.build, services, SERVICES_DIR, BASE_IMAGE=base)
        build_leasekeeper(found)
        if pending is not None:
            pending.result()
    return found
