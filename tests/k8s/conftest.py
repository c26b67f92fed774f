"""Owns the wiring of the Kubernetes provider's integration tests: the cluster harness
fixtures (tests/cluster) plus
- ``kenv``: a provider in a fresh namespace that reaches the real API server through a fault
  proxy (rules, request counts), and an admin client beside it;
- ``kube_stack``: a real Celery worker (tests/stack.py) whose provider is ``kubernetes``, in
  its own namespace, installation id, fault proxy, SQLite store and task queue, driven
  through the producer API the way a web backend drives it. Workers start one test ahead
  (``KubeStackPool``), so a fresh worker per test costs no waiting; ``kube_stack_maker``
  makes such stacks with other settings (warm pools) or another identity (an RBAC role);
- ``frozen_controllers``: the controller manager stopped for a block (a stuck GC).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes import client

from models.schema import Lease, Run
from models.store import Store
from providers.base import AcquireRequest, LeaseHandle
from providers.kubernetes.provider import KubernetesProvider, build_kubernetes_provider
from providers.spec import SandboxSpec
from tests.cluster.cluster import ClusterAccess, KubeCluster
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.fixtures import *  # noqa: F403
from tests.cluster.fixtures import create_namespace, delete_namespace, new_fault_proxy
from tests.cluster.fixtures import prebuild_binaries as _prebuild_binaries
from tests.cluster.sandbox_controller import SandboxController
from tests.cluster.waits import wait_for_object
from tests.services import RedisServer
from workers.settings import Settings

if TYPE_CHECKING:  # both import the Celery app, which must not happen before
    # tests/conftest.py's pytest_configure has pointed it at the test broker
    from tests.stack import WorkerStack

GROUP, PLURAL = "agents.x-k8s.io", "sandboxes"
Obj = dict[str, Any]


def provider_settings(kubeconfig: Path, namespace: str, installation: str,
                      **extra: Any) -> Settings:
    return Settings(kube_config_path=kubeconfig, kube_namespace=namespace,
                    installation_id=installation, **{"kube_request_timeout_s": 10.0, **extra})


@dataclass
class KubeEnv:
    namespace: str
    installation: str
    proxy: FaultProxy
    admin: client.ApiClient
    provider: KubernetesProvider

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.admin)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.admin)

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.admin)

    def new_lease(self) -> str:
        return f"lease-{secrets.token_hex(5)}"

    def request(self, lease_id: str | None = None, timeout_s: float = 30.0,
                **spec: Any) -> AcquireRequest:
        lease_id = lease_id or self.new_lease()
        sandbox_spec = SandboxSpec(tenant="acme", **spec)
        return AcquireRequest(
            lease_id=lease_id, name=self.provider.lease_name(lease_id), spec=sandbox_spec,
            labels={"leasekeeper.dev/run-id": f"run-{lease_id}", "team": "core"},
            timeout_s=timeout_s)

    def handle(self, name: str, backend: str = "sandbox-cr", /, **meta: Any) -> LeaseHandle:
        return LeaseHandle(name=name, backend=str(meta.get("backend", backend)),
                           meta={"namespace": self.namespace, **meta})

    # -- admin reads (not through the proxy) -----------------------------------------------
    def read(self, kind: str, name: str) -> Obj | None:
        calls = {
            "sandbox": lambda: self.custom.get_namespaced_custom_object(
                GROUP, "v1alpha1", self.namespace, PLURAL, name, _preload_content=False),
            "job": lambda: self.batch.read_namespaced_job(name, self.namespace,
                                                          _preload_content=False),
            "pod": lambda: self.core.read_namespaced_pod(name, self.namespace,
                                                         _preload_content=False),
            "secret": lambda: self.core.read_namespaced_secret(name, self.namespace,
                                                               _preload_content=False),
        }
        try:
            found: Obj = json.loads(calls[kind]().data)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    def wait(self, kind: str, name: str, predicate: Any, timeout: float = 30.0) -> Obj | None:
        lists = {
            "sandbox": (lambda **kw: self.custom.list_namespaced_custom_object(
                GROUP, "v1alpha1", self.namespace, PLURAL, **kw)),
            "job": lambda **kw: self.batch.list_namespaced_job(self.namespace, **kw),
            "pod": lambda **kw: self.core.list_namespaced_pod(self.namespace, **kw),
            "secret": lambda **kw: self.core.list_namespaced_secret(self.namespace, **kw),
        }
        return wait_for_object(lists[kind], name, predicate, timeout, f"{kind} {name}")

    def create_sandbox(self, manifest: Obj) -> Obj:
        created: Obj = json.loads(self.custom.create_namespaced_custom_object(
            GROUP, "v1alpha1", self.namespace, PLURAL, manifest, _preload_content=False).data)
        return created


@pytest.fixture
def kenv(kube_cluster: Any, kube_api: client.ApiClient, kubelet_sim: Any,
         sandbox_controller: Any, fault_proxy: FaultProxy, k8s_namespace: str
         ) -> Iterator[KubeEnv]:
    installation = f"it-{secrets.token_hex(3)}"
    settings = provider_settings(fault_proxy.kubeconfig_path, k8s_namespace, installation)
    provider = build_kubernetes_provider(settings)
    yield KubeEnv(k8s_namespace, installation, fault_proxy, kube_api, provider)
    provider.api.api_client.close()


@pytest.fixture
def steered_controller(sandbox_controller: SandboxController | None) -> SandboxController:
    """The Sandbox controller simulator, for tests that make it fail, stall or lag. A real
    agent-sandbox controller (LEASEKEEPER_TEST_REAL_SANDBOX_CONTROLLER=1) cannot be told to."""
    if sandbox_controller is None:
        pytest.skip("steers the Sandbox controller simulator; this cluster runs a real one")
    return sandbox_controller


@pytest.fixture
def frozen_controllers(kube_cluster: ClusterAccess) -> Callable[[], AbstractContextManager[None]]:
    """``with frozen_controllers():`` the controller manager is stopped (no garbage collector,
    no Job controller), as in a cluster whose GC is stuck. Only on the harness's own cluster."""
    if not isinstance(kube_cluster, KubeCluster):
        pytest.skip("freezes the harness's controller manager; this cluster is external")
    return kube_cluster.frozen_controllers


# -- a real worker on the kubernetes provider -------------------------------------------------

def pytest_collection_finish(session: pytest.Session) -> None:
    _prebuild_binaries(session)  # a cold build must not run inside the first test's timeout


@dataclass
class KubeStack:
    """A worker whose only provider is ``kubernetes``. ``env`` reads and waits on the real
    objects with the admin client; ``env.provider`` (same namespace and installation) talks to
    the API server directly, so the proxy counts only the worker's requests."""

    stack: WorkerStack
    env: KubeEnv
    queue: str
    worker: subprocess.Popen[bytes]

    @functools.cached_property
    def store(self) -> Store:
        return Store(self.stack.store_url)

    @property
    def proxy(self) -> FaultProxy:
        return self.env.proxy

    @property
    def namespace(self) -> str:
        return self.env.namespace

    def lease(self, lease_id: str) -> Lease:
        return self.store.get_lease(lease_id)

    def run(self, run_id: str) -> Run:
        run = self.store.get_run(run_id)
        assert run is not None, f"no run {run_id}"
        return run

    def worker_log(self) -> str:
        return self.stack.logfile.read_text(errors="replace")

    def forget(self, lease_id: str) -> None:
        """Delete the lease's rows (lease, events, run) behind the system's back."""
        from sqlalchemy import delete

        from models.schema import LeaseEvent

        with self.store.tx() as s:
            s.execute(delete(LeaseEvent).where(LeaseEvent.lease_id == lease_id))
            s.execute(delete(Run).where(Run.lease_id == lease_id))
            s.execute(delete(Lease).where(Lease.lease_id == lease_id))

    def store_dump(self) -> str:
        """Every row of every table, as text (to look for values that must not be there)."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.stack.store_url)
        try:
            with engine.connect() as conn:
                return "\n".join(f"{table}: {row}"
                                 for table in sa.inspect(engine).get_table_names()
                                 for row in conn.execute(sa.text(f'select * from "{table}"')))
        finally:
            engine.dispose()

    def restart_worker(self, **settings: str) -> None:
        """Stop the worker (SIGTERM, as a deploy would), then start another with these
        settings over the stack's (e.g. another ``LEASEKEEPER_POOLS``) and wait for it."""
        _signal_worker(self.worker, signal.SIGTERM)
        self.worker.wait(30)
        self.stack.extra_env.update(settings)
        self.worker = self.stack.start_worker(concurrency=2)


@dataclass
class KubeStackPool:
    """Hands out a fresh ``KubeStack`` per test and starts the next one meanwhile."""

    make: Callable[[], KubeStack]
    spare: KubeStack | None = None
    retired: list[KubeStack] = field(default_factory=list)

    def take(self) -> KubeStack:
        current = self.spare or self.make()
        self.spare = self.make()
        current.stack.await_worker(current.worker)
        return current

    def retire(self, done: KubeStack) -> None:
        """Stop the worker without waiting (its queue, namespace and proxy are its own)."""
        done.proxy.clear_rules()
        _signal_worker(done.worker, signal.SIGTERM)
        done.store.dispose()
        self.retired.append(done)

    def close(self) -> None:
        stacks = self.retired + ([self.spare] if self.spare else [])
        for ks in stacks:
            _signal_worker(ks.worker, signal.SIGTERM)
        for ks in stacks:
            try:
                ks.worker.wait(20)
            except subprocess.TimeoutExpired:
                _signal_worker(ks.worker, signal.SIGKILL)
                ks.worker.wait(5)
            ks.proxy.stop()
            ks.env.provider.api.api_client.close()
            delete_namespace(ks.env.admin, ks.namespace)


def _signal_worker(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)


def worker_env(proxy: FaultProxy, namespace: str, installation: str,
               queue: str) -> dict[str, str]:
    """The worker settings of a kubernetes-only installation reaching the cluster through
    ``proxy``."""
    return {
        "LEASEKEEPER_PROVIDERS": "kubernetes",
        "LEASEKEEPER_PROVIDER": "kubernetes",
        "LEASEKEEPER_KUBE_CONFIG_PATH": str(proxy.kubeconfig_path),
        "LEASEKEEPER_KUBE_NAMESPACE": namespace,
        "LEASEKEEPER_INSTALLATION_ID": installation,
        "LEASEKEEPER_TASK_QUEUE": queue,
        "LEASEKEEPER_KUBE_REQUEST_TIMEOUT_S": "10",
        # The tests drive sweep.orphans themselves: a terminating workload is stuck at once.
        "LEASEKEEPER_KUBE_TERMINATING_LIMIT_S": "0",
    }


# Who the worker is on the API server: given its namespace and fault proxy, the kubeconfig it
# uses (default: the admin token through the proxy).
Identity = Callable[[str, FaultProxy], Path]


@dataclass(frozen=True)
class KubeStackMaker:
    """Starts ``KubeStack``s: a fresh namespace, installation id, fault proxy, SQLite store
    and task queue each, with ``extra_env`` (e.g. ``LEASEKEEPER_POOLS``) over the
    kubernetes-only settings, and the worker reaching the API server as ``identity`` says."""

    cluster: ClusterAccess
    admin: client.ApiClient
    broker_url: str
    tmp: pytest.TempPathFactory
    extra_env: tuple[tuple[str, str], ...] = ()
    identity: Identity | None = None

    def __call__(self) -> KubeStack:
        from models.migrate import upgrade
        from tests.stack import WorkerStack

        root = self.tmp.mktemp("kube-stack")
        namespace = create_namespace(self.admin)
        installation = f"it-{secrets.token_hex(3)}"
        queue = f"k8s-{namespace}"
        proxy = new_fault_proxy(self.cluster, root / "proxy").start()
        kubeconfig = (self.identity(namespace, proxy) if self.identity
                      else proxy.kubeconfig_path)
        store_url = f"sqlite:///{root / 'store.db'}"
        upgrade(store_url)
        settings = {**worker_env(proxy, namespace, installation, queue),
                    "LEASEKEEPER_KUBE_CONFIG_PATH": str(kubeconfig), **dict(self.extra_env)}
        stack = WorkerStack(name=queue, store_url=store_url, root=root,
                            broker_url=self.broker_url, extra_env=settings)
        direct = build_kubernetes_provider(
            provider_settings(self.cluster.kubeconfig_path, namespace, installation))
        kenv = KubeEnv(namespace, installation, proxy, self.admin, direct)
        return KubeStack(stack, kenv, queue, stack.spawn_worker(concurrency=2))


@pytest.fixture(scope="session")
def kube_stack_maker(kube_cluster: ClusterAccess, kube_api: client.ApiClient, kubelet_sim: Any,
                     sandbox_controller: Any, redis_server: RedisServer,
                     tmp_path_factory: pytest.TempPathFactory) -> KubeStackMaker:
    """Makes kubernetes worker stacks (``dataclasses.replace`` it for other settings or
    another identity); the cluster, its simulators and Redis are up."""
    return KubeStackMaker(kube_cluster, kube_api, redis_server.url, tmp_path_factory)


@pytest.fixture(scope="session")
def kube_stack_pool(kube_stack_maker: KubeStackMaker) -> Iterator[KubeStackPool]:
    pool = KubeStackPool(kube_stack_maker)
    yield pool
    pool.close()


@pytest.fixture
def kube_stack(kube_stack_pool: KubeStackPool) -> Iterator[KubeStack]:
    """A fresh kubernetes worker stack; this test process sends tasks to its queue."""
    from tests.stack import sending_to

    ks = kube_stack_pool.take()
    try:
        with sending_to(ks.queue):
            yield ks
    finally:
        kube_stack_pool.retire(ks)
