"""The only module that talks to the Kubernetes API server.

``build_api_client(settings)`` makes an ``ApiClient`` from LEASEKEEPER_KUBE_CONFIG_PATH /
LEASEKEEPER_KUBE_CONTEXT, or in-cluster config, falling back to $KUBECONFIG / ~/.kube/config.
``KubeApi`` wraps it for one namespace: every call has the configured request timeout,
returns plain JSON dicts exactly as the server sent them (camelCase), and runs inside the
one translation boundary (errors.kube_errors), so callers only ever see ProviderErrors.
Secrets are read and listed as metadata only: their data never enters this process.
Tests inject their own ``ApiClient`` (``KubeApi(api_client, ...)``); nothing is patched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes import config as kube_config
from kubernetes import watch as kube_watch
from kubernetes.client import ApiClient, BatchV1Api, Configuration, CoreV1Api, CustomObjectsApi
from kubernetes.config.config_exception import ConfigException

from providers.errors import ConfigError
from providers.kubernetes.errors import Permission, kube_errors
from providers.kubernetes.manifests import SANDBOX_GROUP, SANDBOX_PLURAL, Backend, Manifest

if TYPE_CHECKING:
    from workers.settings import Settings

Obj = dict[str, Any]
FOREGROUND = "Foreground"
_META_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
_META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
# The RBAC resource and API group behind each workload kind (deploy/rbac/role.yaml grants them).
_RESOURCES: dict[Backend, tuple[str, str]] = {
    Backend.SANDBOX_CR: (SANDBOX_PLURAL, SANDBOX_GROUP),
    Backend.JOB: ("jobs", "batch"),
}


def build_api_client(settings: Settings) -> ApiClient:
    """An ApiClient for the configured cluster. Raises ConfigError naming the setting."""
    configuration = Configuration()
    try:
        if settings.kube_config_path is not None:
            kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(settings.kube_config_path), context=settings.kube_context,
                client_configuration=configuration, persist_config=False)
        else:
            try:
                kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration)
            except ConfigException:
                kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                    context=settings.kube_context,
                                             client_configuration=configuration,
                                             persist_config=False)
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"kubernetes: cannot load cluster configuration ({exc}); set "
            "LEASEKEEPER_KUBE_CONFIG_PATH (and LEASEKEEPER_KUBE_CONTEXT) or run in-cluster"
        ) from None
    # Retry only connection setup (nothing was sent); everything else surfaces as a
    # ProviderError and the task's retry policy decides.
    configuration.retries = urllib3.Retry(total=2, connect=2, read=0, status=0, other=0,
                                          redirect=0)
    return ApiClient(configuration)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    obj: Obj


def _body(manifest: Manifest) -> Any:
    """A JSON manifest as a request body: the client validates it into its own model."""
    return manifest


def _delete_options(uid: str | None, propagation: str | None = None) -> Obj:
    """DeleteOptions: with ``uid`` as precondition the server deletes only that object."""
    options: Obj = {}
    if propagation:
        options["propagationPolicy"] = propagation
    if uid:
        options["preconditions"] = {"uid": uid}
    return options


def _json(response: Any) -> Obj:
    try:
        data = response.data
    finally:
        response.release_conn()
    parsed = json.loads(data) if data else {}
    return parsed if isinstance(parsed, dict) else {}


class KubeApi:
    """Typed calls for one namespace; each returns JSON dicts and raises ProviderErrors."""

    def __init__(self, api_client: ApiClient, namespace: str, request_timeout_s: float,
                 sandbox_api_version: str) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.request_timeout_s = request_timeout_s
        self.sandbox_api_version = sandbox_api_version
        self.core = CoreV1Api(api_client)
        self.batch = BatchV1Api(api_client)
        self.custom = CustomObjectsApi(api_client)

    @property
    def _timeout(self) -> tuple[float, float]:
        return (self.request_timeout_s, self.request_timeout_s)

    def _sandbox_args(self) -> tuple[str, str, str, str]:
        return (SANDBOX_GROUP, self.sandbox_api_version, self.namespace, SANDBOX_PLURAL)

    def _errors(self, verb: str, resource: str | Backend, action: str, *,
                sensitive: bool = False) -> AbstractContextManager[None]:
        """The translation boundary for one call, naming the RBAC rule it needs."""
        plural, group = _RESOURCES[resource] if isinstance(resource, Backend) else (resource, "")
        return kube_errors(action, sensitive=sensitive, namespace=self.namespace,
                           permission=Permission(verb, plural, group))

    # -- workloads (Sandbox or Job) -------------------------------------------------------
    def create_workload(self, backend: Backend, manifest: Manifest) -> Obj:
        name = manifest["metadata"]["name"]
        with self._errors("create", backend, f"create {backend.value} {self.namespace}/{name}"):
            match backend:
                case Backend.SANDBOX_CR:
                    resp = self.custom.create_namespaced_custom_object(
                        *self._sandbox_args(), manifest, _preload_content=False,
                        _request_timeout=self._timeout)
                case Backend.JOB:
                    resp = self.batch.create_namespaced_job(
                        self.namespace, _body(manifest), _preload_content=False,
                        _request_timeout=self._timeout)
            return _json(resp)

    def get_workload(self, backend: Backend, name: str) -> Obj:
        with self._errors("get", backend, f"read {backend.value} {self.namespace}/{name}"):
            match backend:
                case Backend.SANDBOX_CR:
                    resp = self.custom.get_namespaced_custom_object(
                        *self._sandbox_args(), name, _preload_content=False,
                        _request_timeout=self._timeout)
                case Backend.JOB:
                    resp = self.batch.read_namespaced_job(
                        name, self.namespace, _preload_content=False,
                        _request_timeout=self._timeout)
            return _json(resp)

    def delete_workload(self, backend: Backend, name: str, uid: str | None) -> Obj:
        """Foreground delete; with ``uid`` only that incarnation is deleted (409 otherwise)."""
        options = _delete_options(uid, propagation=FOREGROUND)
        with self._errors("delete", backend, f"delete {backend.value} {self.namespace}/{name}"):
            match backend:
                case Backend.SANDBOX_CR:
                    resp = self.custom.delete_namespaced_custom_object(
                        *self._sandbox_args(), name, body=_body(options), _preload_content=False,
                        _request_timeout=self._timeout)
                case Backend.JOB:
                    resp = self.batch.delete_namespaced_job(
                        name, self.namespace, body=_body(options), _preload_content=False,
                        _request_timeout=self._timeout)
            return _json(resp)

    def list_workloads(self, backend: Backend, label_selector: str) -> list[Obj]:
        with self._errors("list", backend, f"list {backend.value} in {self.namespace}"):
            match backend:
                case Backend.SANDBOX_CR:
                    resp = self.custom.list_namespaced_custom_object(
                        *self._sandbox_args(), label_selector=label_selector,
                        _preload_content=False, _request_timeout=self._timeout)
                case Backend.JOB:
                    resp = self.batch.list_namespaced_job(
                        self.namespace, label_selector=label_selector,
                        _preload_content=False, _request_timeout=self._timeout)
            return list(_json(resp).get("items") or [])

    def watch_sandbox(self, name: str, resource_version: str | None,
                      timeout_s: int) -> Iterator[WatchEvent]:
        """Events for one Sandbox after ``resource_version``; the server ends the stream
        after ``timeout_s``. 410 Expired surfaces as KubeExpired."""
        watcher = kube_watch.Watch()  # type: ignore[no-untyped-call]
        stream = watcher.stream(  # type: ignore[no-untyped-call]
            self.custom.list_namespaced_custom_object, *self._sandbox_args(),
            field_selector=f"metadata.name={name}", resource_version=resource_version,
            timeout_seconds=timeout_s, allow_watch_bookmarks=True,
            _request_timeout=(self.request_timeout_s, timeout_s + self.request_timeout_s))
        with self._errors("watch", Backend.SANDBOX_CR,
                          f"watch sandbox-cr {self.namespace}/{name}"):
            try:
                for event in stream:
                    yield WatchEvent(str(event["type"]), dict(event["raw_object"]))
            finally:
                stream.close()  # closes the response, so the server-side watch ends too

    # -- secrets (metadata only on the way in) ----------------------------------------------
    def create_secret(self, manifest: Manifest) -> Obj:
        name = manifest["metadata"]["name"]
        with self._errors("create", "secrets", f"create Secret {self.namespace}/{name}",
                          sensitive=True):
            resp = self.core.create_namespaced_secret(
                self.namespace, _body(manifest), _preload_content=False,
                _request_timeout=self._timeout)
            obj = _json(resp)
        obj.pop("data", None)
        obj.pop("stringData", None)
        return obj

    def get_secret_metadata(self, name: str) -> Obj:
        with self._errors("get", "secrets", f"read Secret {self.namespace}/{name}",
                          sensitive=True):
            return _json(self.core.read_namespaced_secret(
                name, self.namespace, _preload_content=False, _request_timeout=self._timeout,
                _headers={"Accept": _META_ONLY}))

    def delete_secret(self, name: str, uid: str | None = None) -> Obj:
        """With ``uid`` only that Secret is deleted (409 if the name holds another)."""
        with self._errors("delete", "secrets", f"delete Secret {self.namespace}/{name}",
                          sensitive=True):
            return _json(self.core.delete_namespaced_secret(
                name, self.namespace, body=_body(_delete_options(uid)), _preload_content=False,
                _request_timeout=self._timeout, _headers={"Accept": _META_ONLY}))

    def list_secret_metadata(self, label_selector: str) -> list[Obj]:
        with self._errors("list", "secrets", f"list Secrets in {self.namespace}",
                          sensitive=True):
            return list(_json(self.core.list_namespaced_secret(
                self.namespace, label_selector=label_selector, _preload_content=False,
                _request_timeout=self._timeout, _headers={"Accept": _META_LIST}),
            ).get("items") or [])

    # -- pods ---------------------------------------------------------------------------
    def get_pod(self, name: str) -> Obj:
        with self._errors("get", "pods", f"read Pod {self.namespace}/{name}"):
            return _json(self.core.read_namespaced_pod(
                name, self.namespace, _preload_content=False, _request_timeout=self._timeout))

    def delete_pod(self, name: str, uid: str | None = None) -> Obj:
        """With ``uid`` only that pod is deleted (409 if the name holds another)."""
        with self._errors("delete", "pods", f"delete Pod {self.namespace}/{name}"):
            return _json(self.core.delete_namespaced_pod(
                name, self.namespace, body=_body(_delete_options(uid)), _preload_content=False,
                _request_timeout=self._timeout))

    def list_pods(self, label_selector: str) -> list[Obj]:
        with self._errors("list", "pods", f"list Pods in {self.namespace} ({label_selector})"):
            return list(_json(self.core.list_namespaced_pod(
                self.namespace, label_selector=label_selector, _preload_content=False,
                _request_timeout=self._timeout)).get("items") or [])
