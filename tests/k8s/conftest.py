"""Owns the wiring of the Kubernetes provider's integration tests: the cluster harness
fixtures (tests/cluster) plus ``kenv``, a provider in a fresh namespace that reaches the real
API server through a fault proxy (rules, request counts), and an admin client beside it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from providers.base import AcquireRequest, LeaseHandle
from providers.kubernetes.provider import KubernetesProvider, build_kubernetes_provider
from providers.spec import SandboxSpec
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.fixtures import *  # noqa: F403
from tests.cluster.waits import wait_for_object
from workers.settings import Settings

GROUP, PLURAL = "agents.x-k8s.io", "sandboxes"
Obj = dict[str, Any]


def provider_settings(kubeconfig: Path, namespace: str, installation: str,
                      **extra: Any) -> Settings:
    return Settings(kube_config_path=kubeconfig, kube_namespace=namespace,
                    installation_id=installation, kube_request_timeout_s=10.0, **extra)


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
