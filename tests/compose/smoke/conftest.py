"""pytest-celery against the compose-built leasekeeper image, on this machine's terms.

pytest-celery's defaults pull ``redis:latest`` and build a worker ``FROM python:3.10-slim``
on a bridge network per session. Overridden here: the network is the host's (the test
engine has no bridge); broker and result backend are Redis containers of the local
services image on fixed free loopback ports, ready once Redis says so (a host-network
container has no IP to wait for); the worker container is the image docker-compose.yml
builds from the project's Dockerfile, running ``celery -A workers.app worker`` with
leasekeeper's own settings (a SQLite store and the ``faulty`` provider's fault plan in a
bind-mounted directory the test reads too); its node name comes from its command.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import docker as docker_sdk
import pytest
from pytest_celery import (
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryWorkerContainer,
    RedisContainer,
    RedisTestBackend,
    RedisTestBroker,
)
from pytest_docker_tools import container, fxtr
from pytest_docker_tools.exceptions import ContainerFailed

from models.migrate import upgrade
from models.store import Store
from providers.faulty import FaultPlan
from tests.compose.engine import DockerEngine, Images
from tests.services import free_port
from tests.stack import TEST_SETTINGS

WORKER_UID = 10001  # the Dockerfile's leasekeeper user
STATE_DIR = "/var/lib/leasekeeper"


class HostRedisContainer(RedisContainer):
    """Redis on the host network at the port its command names."""

    @property
    def port(self) -> int:
        command: list[str] = self.attrs["Config"]["Cmd"]
        return int(command[command.index("--port") + 1])

    @property
    def hostname(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return f"{self.prefix()}127.0.0.1:{self.port}/{self.vhost}"

    @property
    def host_url(self) -> str:
        return self.url

    def ready(self) -> bool:
        return _running(self) and self._wait_ready()


class LeasekeeperWorkerContainer(CeleryWorkerContainer):
    """The leasekeeper worker as its image runs it (the app is workers.app, not an
    injected test module)."""

    @classmethod
    def worker_name(cls) -> str:
        return "leasekeeper-smoke"

    @classmethod
    def command(cls, *args: str, debugpy: bool = False, wait_for_client: bool = True,
                **kwargs: dict[str, Any]) -> list[str]:
        return ["celery", "-A", "workers.app", "worker", "-P", "prefork", "-c", "2", "-E",
                "-l", "info", "-n", f"{cls.worker_name()}@%h",
                # No -Q: as in the image, the worker consumes every lane (workers/queues.py);
                # the follow-up tasks a task sends (run.finish's reclaim) go to their lane.
                "--without-gossip", "--without-mingle", *args]

    def ready(self) -> bool:
        return _running(self) and self.ready_prompt in self.logs()


def _running(node: Any) -> bool:
    node.reload()
    if node.status == "exited":
        raise ContainerFailed(node, f"{node.name} exited:\n{node.logs()[-3000:]}")
    return bool(node.status == "running")


@pytest.fixture(scope="session")
def docker_client(docker: DockerEngine) -> Iterator[docker_sdk.DockerClient]:
    client = docker_sdk.DockerClient(base_url=docker.host)
    yield client
    client.close()


@pytest.fixture(scope="session")
def default_pytest_celery_network() -> SimpleNamespace:
    return SimpleNamespace(name="host")


@pytest.fixture(scope="session")
def services_image(stack_images: Images) -> str:
    return stack_images.services


@pytest.fixture(scope="session")
def celery_base_worker_image(stack_images: Images,
                             docker_client: docker_sdk.DockerClient) -> Any:
    return docker_client.images.get(stack_images.leasekeeper)


def _redis_command(port: int) -> list[str]:
    return [*RedisContainer.command(), "--port", str(port), "--bind", "127.0.0.1"]


# Broker, backend and worker containers live for the module (each test sends its own runs
# and writes its own fault plan); pytest-celery's per-test wrappers sit on top of them.
@pytest.fixture(scope="module")
def redis_broker_command() -> list[str]:
    return _redis_command(free_port())


@pytest.fixture(scope="module")
def redis_backend_command() -> list[str]:
    return _redis_command(free_port())


default_redis_broker = container(
    scope="module",
    image="{services_image}",
    network="{default_pytest_celery_network.name}",
    command=fxtr("redis_broker_command"),
    wrapper_class=HostRedisContainer,
    timeout=60,
)

default_redis_backend = container(
    scope="module",
    image="{services_image}",
    network="{default_pytest_celery_network.name}",
    command=fxtr("redis_backend_command"),
    wrapper_class=HostRedisContainer,
    timeout=60,
)


@pytest.fixture
def celery_broker_cluster(celery_redis_broker: RedisTestBroker) -> Iterator[CeleryBrokerCluster]:
    cluster = CeleryBrokerCluster(celery_redis_broker)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(celery_redis_backend: RedisTestBackend,
                           ) -> Iterator[CeleryBackendCluster]:
    cluster = CeleryBackendCluster(celery_redis_backend)
    yield cluster
    cluster.teardown()


@pytest.fixture(scope="module")
def worker_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's /var/lib/leasekeeper: a migrated SQLite store and the fault plan."""
    state = tmp_path_factory.mktemp("worker-state")
    upgrade(f"sqlite:///{state / 'store.db'}")
    for path in [state, *state.iterdir()]:
        os.chown(path, WORKER_UID, WORKER_UID)
    return state


@pytest.fixture(scope="module")
def worker_store(worker_state: Path) -> Iterator[Store]:
    store = Store(f"sqlite:///{worker_state / 'store.db'}")
    yield store
    store.dispose()


class WorkerFaultPlan(FaultPlan):
    """The fault plan, written by the test and consumed by the worker's user."""

    def write(self, plan: dict[str, list[dict[str, Any]]]) -> None:
        super().write(plan)
        os.chown(self.path, WORKER_UID, WORKER_UID)


@pytest.fixture
def fault_plan(worker_state: Path) -> FaultPlan:
    return WorkerFaultPlan(worker_state / "faults.json")


@pytest.fixture
def default_worker_container_cls() -> type[CeleryWorkerContainer]:
    return LeasekeeperWorkerContainer


@pytest.fixture(scope="session")
def default_worker_container_session_cls() -> type[CeleryWorkerContainer]:
    return LeasekeeperWorkerContainer


@pytest.fixture(scope="module")
def leasekeeper_worker_env(default_redis_broker: HostRedisContainer,
                           default_redis_backend: HostRedisContainer) -> dict[str, str]:
    broker, backend = default_redis_broker.url, default_redis_backend.url
    return {**TEST_SETTINGS, "LEASEKEEPER_BROKER_URL": broker,
            "LEASEKEEPER_RESULT_BACKEND_URL": backend,
            "LEASEKEEPER_STORE_URL": f"sqlite:///{STATE_DIR}/store.db",
            "LEASEKEEPER_FAULTS_FILE": f"{STATE_DIR}/faults.json",
            "LEASEKEEPER_INSTALLATION_ID": "smoke"}


@pytest.fixture(scope="module")
def leasekeeper_worker_command() -> list[str]:
    return LeasekeeperWorkerContainer.command()


@pytest.fixture(scope="module")
def leasekeeper_worker_volumes(worker_state: Path) -> dict[str, dict[str, str]]:
    return {str(worker_state): {"bind": STATE_DIR, "mode": "rw"}}


default_worker_container = container(
    scope="module",
    image="{celery_base_worker_image.id}",
    network="{default_pytest_celery_network.name}",
    environment=fxtr("leasekeeper_worker_env"),
    volumes=fxtr("leasekeeper_worker_volumes"),
    command=fxtr("leasekeeper_worker_command"),
    init=True,
    wrapper_class=LeasekeeperWorkerContainer,
    timeout=180,
)
