"""A real compose stack: the project's docker-compose.yml plus docker-compose.test.yml (local
images, host networking, free loopback ports), under its own project name, driven through
``docker-compose`` like a user would, and reached from outside the stack the way a web
backend would: Celery by task name on the stack's Redis, the store on its PostgreSQL.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from celery import Celery

from models.store import Store
from tests.compose.engine import REPO, DockerEngine, Images
from tests.services import free_port
from workers.app import create_app
from workers.settings import Settings

COMPOSE_FILE = REPO / "docker-compose.yml"
TEST_OVERRIDE = Path(__file__).resolve().parent / "docker-compose.test.yml"
FLOWER_AUTH = ("ops", "compose-test-password")


@dataclass
class ComposeStack:
    engine: DockerEngine
    images: Images
    project: str = field(default_factory=lambda: f"lk{uuid.uuid4().hex[:8]}")
    redis_port: int = field(default_factory=free_port)
    postgres_port: int = field(default_factory=free_port)
    flower_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    console_port: int = field(default_factory=free_port)

    @property
    def env(self) -> dict[str, str]:
        # The test session's own LEASEKEEPER_* settings must not leak into the compose file.
        clean = {k: v for k, v in self.engine.env.items() if not k.startswith("LEASEKEEPER_")}
        return {**clean, "LK_TEST_BASE_IMAGE": self.images.base,
                "LK_TEST_SERVICES_IMAGE": self.images.services,
                "LK_TEST_IMAGE": self.images.leasekeeper,
                "LK_TEST_REDIS_PORT": str(self.redis_port),
                "LK_TEST_POSTGRES_PORT": str(self.postgres_port),
                "LK_TEST_FLOWER_PORT": str(self.flower_port),
                "LK_TEST_METRICS_PORT": str(self.metrics_port),
                "LK_TEST_CONSOLE_PORT": str(self.console_port),
                "LEASEKEEPER_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)}

    @cached_property
    def compose_file(self) -> Path:
        """docker-compose.yml with the test override merged in, minus published ports:
        host networking has none to publish (compose 1.29 refuses both together, and an
        override file cannot remove a list)."""
        done = subprocess.run(
            ["docker-compose", "-f", str(COMPOSE_FILE), "-f", str(TEST_OVERRIDE), "config"],
            capture_output=True, text=True, env=self.env, cwd=REPO, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        merged = yaml.safe_load(done.stdout)
        for service in merged["services"].values():
            assert service.get("network_mode") == "host", service
            service.pop("ports", None)
        path = Path(tempfile.mkdtemp(prefix=f"{self.project}-")) / "docker-compose.yml"
        path.write_text(yaml.safe_dump(merged))
        return path

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True,
                ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["docker-compose", "-p", self.project, "--project-directory", str(REPO),
             "-f", str(self.compose_file), *args],
            capture_output=True, text=True, env=self.env, cwd=REPO, timeout=timeout_s,
            check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} exited {done.returncode}:\n"
                                 f"{done.stderr[-4000:]}")
        return done

    # -- lifecycle ----------------------------------------------------------------------
    def build(self) -> None:
        self.compose("build", timeout_s=1800)

    def up(self) -> None:
        self.compose("up", "-d", timeout_s=900)
        self.wait_healthy("worker", "beat")

    def down(self, volumes: bool = False) -> None:
        self.compose("down", *(["-v"] if volumes else []), "-t", "60", timeout_s=300,
                     check=False)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    # -- containers ---------------------------------------------------------------------
    def container_ids(self, service: str) -> list[str]:
        """The service's containers, running or not (the docker CLI answers faster than
        ``docker-compose ps``)."""
        out = self.engine.docker(
            "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}").stdout
        return [line for line in out.split() if line]

    def container_id(self, service: str) -> str:
        ids = self.container_ids(service)
        assert len(ids) == 1, f"{service}: expected one container, found {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        done = self.engine.docker("inspect", self.container_id(service))
        loaded: list[dict[str, Any]] = json.loads(done.stdout)
        return loaded[0]

    def health(self, service: str) -> str:
        return str(self.inspect(service)["State"].get("Health", {}).get("Status", "none"))

    def wait_healthy(self, *services: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(services)
        while pending:
            for service in list(pending):
                state = self.inspect(service)["State"]
                if state.get("Health", {}).get("Status") == "healthy":
                    pending.remove(service)
                elif not state["Running"]:
                    raise AssertionError(f"{service} exited ({state['ExitCode']}):\n"
                                         f"{self.logs(service)[-3000:]}")
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"{pending} not healthy within {timeout_s}s:\n"
                                     + "\n".join(self.logs(s)[-2000:] for s in pending))
            time.sleep(1)

    def run_healthcheck(self, service: str) -> int:
        """Run the service's own health check command in its container now."""
        kind, *command = self.inspect(service)["Config"]["Healthcheck"]["Test"]
        argv = ["sh", "-c", command[0]] if kind == "CMD-SHELL" else command
        return self.engine.docker("exec", self.container_id(service), *argv,
                                  timeout_s=120).returncode

    def exec(self, service: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.engine.docker("exec", self.container_id(service), *argv, timeout_s=120)

    def host_pids(self, service: str) -> list[int]:
        """Every process in the service's container, as host pids."""
        done = self.engine.docker("top", self.container_id(service), "-eo", "pid")
        return [int(line) for line in done.stdout.split()[1:] if line.strip().isdigit()]

    # -- outside the stack: the producer and the store ----------------------------------
    @property
    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def store_url(self) -> str:
        return (f"postgresql+psycopg://leasekeeper:leasekeeper@127.0.0.1:{self.postgres_port}"
                "/leasekeeper")

    @cached_property
    def app(self) -> Celery:
        """A producer's Celery app on the stack's Redis (sends tasks by name)."""
        return create_app(Settings(broker_url=self.broker_url, store_url=self.store_url,
                                   providers=["local"], provider="local"))

    @cached_property
    def store(self) -> Store:
        return Store(self.store_url)

    def send(self, task: str, **kwargs: Any) -> Any:
        return self.app.send_task(task, kwargs=kwargs)

    def close_clients(self) -> None:
        if "app" in self.__dict__:
            consumer = getattr(self.app.backend, "result_consumer", None)
            if consumer is not None:
                consumer.stop()
                consumer.subscribed_to.clear()
            self.app.close()
        if "store" in self.__dict__:
            self.store.dispose()
