"""The only module that talks to the Kubernetes API server.

``build_api_client(settings)`` makes an ``ApiClient`` from LEASEKEEPER_KUBE_CONFIG_PATH /
LEASEKEEPER_KUBE_CONTEXT, or in-cluster config, falling back to $KUBECONFIG / ~/.kube/config.
``KubeApi`` wraps it for one namespace: every call has the configured request timeout,
returns plain JSON dicts exactly as the server sent them (camelCase), and runs inside the
one translation boundary (errors.kube_errors), so callers only ever see ProviderErrors.
Secrets are read and listed as metadata only: their data never enters this process.
Tests inject their own ``ApiClient`` (``KubeApi(api_client, ...)``); nothing is patched.

``exec_with_stdin`` runs a command in a container through the official client's ``stream``
(WebSocket ``pods/exec``), its input on stdin, under one monotonic deadline. The client's
WebSocket connect has no timeout of its own, so it runs in a helper thread the call stops
waiting for at the deadline (a connection that arrives later is closed at once). ``stream``
swaps ``call_api`` on the ApiClient it is given for the duration of the call, so every exec
gets a fresh ApiClient of the same configuration, never the one the REST calls share.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import urllib3
import websocket
from kubernetes import config as kube_config
from kubernetes import watch as kube_watch
from kubernetes.client import ApiClient, BatchV1Api, Configuration, CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.stream import stream as kube_stream
from kubernetes.stream.ws_client import ERROR_CHANNEL, STDERR_CHANNEL, STDOUT_CHANNEL, WSClient

from providers.errors import TASK_RETRIES, ConfigError, TransientProviderError
from providers.kubernetes.errors import (
    CommandExit,
    Permission,
    command_exit_error,
    kube_errors,
    scrub,
    translate_status,
)
from providers.kubernetes.manifests import SANDBOX_GROUP, SANDBOX_PLURAL, Backend, Manifest
from providers.kubernetes.status import ExecEnd, exec_status

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
    # Not on a Retry-After either (urllib3 would retry a GET or DELETE answered 429 or 503
    # with one, exhaust status=0 at once and hide the answer in a MaxRetryError): the
    # status comes back as it is, and the task's backoff waits.
    configuration.retries = urllib3.Retry(total=2, connect=2, read=0, status=0, other=0,
                                          redirect=0, respect_retry_after_header=False)
    return ApiClient(configuration)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    obj: Obj


@dataclass(frozen=True)
class Listed:
    """A list's items and its resourceVersion."""

    items: list[Obj]
    resource_version: str | None  # of the list: a watch from here misses nothing


@dataclass(frozen=True)
class ExecOutput:
    """What a command that exited 0 printed (secret values scrubbed)."""

    stdout: str
    stderr: str


class _ExecStream:
    """The typed face of the client's (untyped) ``WSClient``: the few calls exec makes."""

    def __init__(self, ws: WSClient) -> None:
        self.ws = ws

    def settimeout(self, seconds: float) -> None:
        self.ws.sock.settimeout(seconds)

    def send_stdin(self, data: bytes) -> None:
        self.ws.write_stdin(data)  # type: ignore[no-untyped-call]

    def is_open(self) -> bool:
        return bool(self.ws.is_open())  # type: ignore[no-untyped-call]

    def pump(self, timeout_s: float) -> None:
        """Buffer every frame that arrives within ``timeout_s``."""
        self.ws.update(timeout=timeout_s)  # type: ignore[no-untyped-call]

    def channel(self, number: int) -> str:
        data = self.ws.read_channel(number, timeout=0)  # type: ignore[no-untyped-call]
        return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data or "")

    def close(self) -> None:
        self.ws.close()  # type: ignore[no-untyped-call]


def _handshake_error(exc: BaseException) -> BaseException:
    """What really failed when ``stream`` raised: it wraps every connect failure in an
    ``ApiException`` with status 0, the HTTP answer (a 403, a 404, a 500) or the socket
    error only in its context. Give the translation boundary the real thing."""
    if not isinstance(exc, ApiException) or exc.status:
        return exc
    cause = exc.__context__
    if isinstance(cause, websocket.WebSocketBadStatusException):
        code = int(cause.status_code)
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = ""
        answer = ApiException(status=code, reason=cause.status_message or phrase)
        answer.body = cause.resp_body  # type: ignore[assignment]  # bytes: _status_body decodes
        return answer
    return cause if cause is not None else exc


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
        return self.list_pods_versioned(label_selector).items

    def list_pods_versioned(self, label_selector: str) -> Listed:
        with self._errors("list", "pods", f"list Pods in {self.namespace} ({label_selector})"):
            listed = _json(self.core.list_namespaced_pod(
                self.namespace, label_selector=label_selector, _preload_content=False,
                _request_timeout=self._timeout))
        version = (listed.get("metadata") or {}).get("resourceVersion")
        return Listed(list(listed.get("items") or []), str(version) if version else None)

    def watch_pods(self, label_selector: str, resource_version: str | None,
                   timeout_s: int) -> Iterator[WatchEvent]:
        """Events for the pods matching ``label_selector`` after ``resource_version``; the
        server ends the stream after ``timeout_s``. 410 Expired surfaces as KubeExpired."""
        return self._watch(self.core.list_namespaced_pod, "pods",
                           f"watch Pods in {self.namespace} ({label_selector})",
                           resource_version, timeout_s, label_selector=label_selector)

    # -- events (of core/v1: what a controller said about an object) ---------------------
    def list_events_versioned(self, field_selector: str) -> Listed:
        """The Events matching ``field_selector`` (``involvedObject.uid=...``), and the
        list's resourceVersion."""
        with self._errors("list", "events",
                          f"list Events in {self.namespace} ({field_selector})"):
            listed = _json(self.core.list_namespaced_event(
                self.namespace, field_selector=field_selector, _preload_content=False,
                _request_timeout=self._timeout))
        version = (listed.get("metadata") or {}).get("resourceVersion")
        return Listed(list(listed.get("items") or []), str(version) if version else None)

    def watch_events(self, field_selector: str, resource_version: str | None,
                     timeout_s: int) -> Iterator[WatchEvent]:
        return self._watch(self.core.list_namespaced_event, "events",
                           f"watch Events in {self.namespace} ({field_selector})",
                           resource_version, timeout_s, field_selector=field_selector)

    def _watch(self, list_call: Callable[..., Any], resource: str, action: str,
               resource_version: str | None, timeout_s: int, **selector: str,
               ) -> Iterator[WatchEvent]:
        """One watch of ``list_call`` after ``resource_version``; the server ends the
        stream after ``timeout_s``. 410 Expired surfaces as KubeExpired."""
        watcher = kube_watch.Watch()  # type: ignore[no-untyped-call]
        stream = watcher.stream(  # type: ignore[no-untyped-call]
            list_call, self.namespace, resource_version=resource_version,
            timeout_seconds=timeout_s, allow_watch_bookmarks=True,
            _request_timeout=(self.request_timeout_s, timeout_s + self.request_timeout_s),
            **selector)
        with self._errors("watch", resource, action):
            try:
                for event in stream:
                    yield WatchEvent(str(event["type"]), dict(event["raw_object"]))
            finally:
                stream.close()

    # -- exec ---------------------------------------------------------------------------
    def exec_with_stdin(self, pod: str, container: str, command: Sequence[str], stdin: bytes,
                        timeout_s: float, *, exits: Mapping[int, CommandExit],
                        failed_hint: str, secrets: Collection[str] = (),
                        clock: Callable[[], float] = time.monotonic) -> ExecOutput:
        """Run ``command`` in ``pod``'s ``container`` with ``stdin`` as its input and wait
        for its exit status, all within ``timeout_s``. Exit 0 returns what it printed; a
        non-zero exit raises as ``exits`` says (else terminal, with ``failed_hint``); every
        other failure raises the ProviderError of the translation boundary (403 names the
        verb on ``pods/exec`` the API server refused). ``command`` goes into the request URL
        (the API server and its audit log see it): data belongs in ``stdin``. Nothing
        printed is quoted before ``secrets`` are scrubbed from it."""
        action = f"exec into Pod {self.namespace}/{pod} (container {container})"
        deadline = clock() + timeout_s
        with self._errors("create", "pods/exec", action):
            ws = _ExecStream(self._open_exec(pod, container, list(command), deadline, clock,
                                             action))
            try:
                _exchange(ws, stdin, deadline, clock, timeout_s, action)
                raw_status = ws.channel(ERROR_CHANNEL)
                stdout, stderr = ws.channel(STDOUT_CHANNEL), ws.channel(STDERR_CHANNEL)
            finally:
                ws.close()
        outcome = exec_status(raw_status)
        match outcome.end:
            case ExecEnd.SUCCEEDED:
                return ExecOutput(scrub(stdout, secrets), scrub(stderr, secrets))
            case ExecEnd.EXITED:
                raise command_exit_error(action, outcome.exit_code or 0, stderr or stdout,
                                         exits, failed_hint, secrets)
            case ExecEnd.FAILED:
                raise translate_status(action, outcome.status or {},
                                       permission=Permission("create", "pods/exec"),
                                       namespace=self.namespace)
            case ExecEnd.MISSING:
                raise TransientProviderError(
                    f"kubernetes: {action} failed: the stream closed without an exit status"
                    + TASK_RETRIES)

    def _open_exec(self, pod: str, container: str, command: list[str], deadline: float,
                   clock: Callable[[], float], action: str) -> WSClient:
        """The connected exec stream, or the connect's error, or a TransientProviderError
        at ``deadline``."""
        api_client = ApiClient(self.api_client.configuration)
        core = CoreV1Api(api_client)
        lock = threading.Lock()
        done = threading.Event()
        outcome: list[WSClient | BaseException] = []
        abandoned = False

        def connect() -> None:
            result: WSClient | BaseException
            try:
                result = kube_stream(
                    core.connect_get_namespaced_pod_exec, pod, self.namespace,
                    container=container, command=command, stdin=True, stdout=True,
                    stderr=True, tty=False, _preload_content=False)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                result = exc
            with lock:
                if abandoned and isinstance(result, WSClient):
                    _ExecStream(result).close()
                else:
                    outcome.append(result)
            api_client.close()  # type: ignore[no-untyped-call]
            done.set()

        threading.Thread(target=connect, name=f"exec-connect-{pod}", daemon=True).start()
        done.wait(max(0.0, deadline - clock()))
        with lock:
            if not outcome:
                abandoned = True
                raise TransientProviderError(
                    f"kubernetes: {action} failed: the API server did not open the exec "
                    "stream in time" + TASK_RETRIES)
            result = outcome[0]
        if isinstance(result, BaseException):
            raise _handshake_error(result)
        return result


def _exchange(ws: _ExecStream, stdin: bytes, deadline: float, clock: Callable[[], float],
              timeout_s: float, action: str) -> None:
    """Send ``stdin``, then read every frame until the server closes the stream."""
    ws.settimeout(max(deadline - clock(), 0.001))
    if stdin:
        ws.send_stdin(stdin)
    while ws.is_open():
        remaining = deadline - clock()
        if remaining <= 0:
            raise TransientProviderError(
                f"kubernetes: {action} failed: the command did not finish within "
                f"{timeout_s:g}s{TASK_RETRIES}")
        ws.pump(remaining)
