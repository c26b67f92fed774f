"""Owns the Sandbox controller simulator for ``sandboxes.agents.x-k8s.io`` (the CRD is
``sandbox-crd.yaml`` beside this file; ``install_sandbox_crd`` applies it).

Like kubernetes-sigs/agent-sandbox it creates the pod named after the Sandbox (or the name in
the ``agents.x-k8s.io/pod-name`` annotation) from ``spec.podTemplate`` with the
``agents.x-k8s.io/sandbox-name-hash`` label and a controller ownerReference, mirrors the pod into
``status.conditions`` (Ready: DependenciesReady / DependenciesNotReady / PodSucceeded / PodFailed /
SandboxSuspended / SandboxExpired; Finished; Suspended), ``status.selector``, ``status.podIPs``
and ``status.nodeName``, honours ``spec.shutdownTime`` + ``shutdownPolicy`` and suspension
(v1alpha1 ``replicas: 0`` / v1beta1 ``operatingMode: Suspended``). Tests can make it never
create a pod (``never_ready``), report a Sandbox as failed (``mark_failed``), or stop
reconciling one (``freeze``: its status then lags its pod, as a slow controller's does).
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import yaml
from kubernetes import client

from tests.cluster import k8s_json
from tests.cluster.informer import Informer, Obj, obj_key

log = logging.getLogger(__name__)
GROUP, PLURAL, KIND = "agents.x-k8s.io", "sandboxes", "Sandbox"
STORAGE_VERSION = "v1beta1"
NAME_HASH_LABEL = "agents.x-k8s.io/sandbox-name-hash"
POD_NAME_ANNOTATION = "agents.x-k8s.io/pod-name"
CRD_PATH = Path(__file__).with_name("sandbox-crd.yaml")
Behaviour = Literal["normal", "never-ready", "failed", "frozen"]


def name_hash(name: str) -> str:
    """agent-sandbox's NameHash: FNV-1a 32-bit of the name as 8 hex digits."""
    value = 0x811C9DC5
    for byte in name.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"{value:08x}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def install_sandbox_crd(api: client.ApiClient, timeout: float = 30.0) -> None:
    """Create the Sandbox CRD unless it exists, and wait until both versions are served."""
    ext = client.ApiextensionsV1Api(api)
    body = yaml.safe_load(CRD_PATH.read_text())
    try:
        ext.create_custom_resource_definition(body, _preload_content=False)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    custom = client.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout
    while True:
        try:
            for version in ("v1alpha1", "v1beta1"):
                custom.list_cluster_custom_object(GROUP, version, PLURAL, limit=1,
                                                  _preload_content=False)
            return
        except client.ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _condition(kind: str, status: bool, reason: str, message: str, generation: int) -> Obj:
    return {"type": kind, "status": "True" if status else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


class SandboxController:
    """Reconciles Sandboxes in all namespaces from one worker thread; context manager."""

    def __init__(self, api: client.ApiClient, *, create_pods: bool = True,
                 version: str = STORAGE_VERSION) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.version = version
        self.create_pods = create_pods
        self.behaviour_hook: Callable[[Obj], Behaviour | None] | None = None
        self._overrides: dict[tuple[str, str | None], tuple[Behaviour, str]] = {}
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reconciling = threading.Lock()  # held by the worker around each reconcile
        self._timers: set[threading.Timer] = set()
        self._stopping = threading.Event()
        self.sandboxes = Informer(
            "sandboxes", functools.partial(self.custom.list_cluster_custom_object,
                                           GROUP, version, PLURAL), self._on_sandbox)
        self.pods = Informer("sandbox-pods", self.core.list_pod_for_all_namespaces,
                             self._on_pod, label_selector=NAME_HASH_LABEL)
        self._worker: threading.Thread | None = None
        self.reconciles = 0

    # -- test controls --------------------------------------------------------------------
    def never_ready(self, namespace: str, name: str | None = None) -> None:
        """Do not create pods for Sandbox ``name`` (every Sandbox of the namespace if None)."""
        self._set(namespace, name, "never-ready", "")

    def mark_failed(self, namespace: str, name: str | None = None,
                    message: str = "simulated pod failure") -> None:
        """Report Sandbox ``name`` (or all of the namespace) as Ready=False PodFailed, Finished."""
        self._set(namespace, name, "failed", message)

    def freeze(self, namespace: str, name: str | None = None) -> None:
        """Stop reconciling Sandbox ``name`` (or all of the namespace): its status stays as
        it is now, whatever happens to its pod. Returns once no reconcile is in flight."""
        with self._reconciling:
            self._set(namespace, name, "frozen", "")

    def reset(self, namespace: str, name: str | None = None) -> None:
        self._set(namespace, name, None, "")

    def _set(self, namespace: str, name: str | None, behaviour: Behaviour | None,
             message: str) -> None:
        with self._lock:
            if behaviour is None:
                self._overrides.pop((namespace, name), None)
            else:
                self._overrides[(namespace, name)] = (behaviour, message)
        for sandbox in self.sandboxes.items():
            meta = sandbox["metadata"]
            if meta["namespace"] == namespace and name in (None, meta["name"]):
                self._queue.put(obj_key(sandbox))

    def _behaviour(self, sandbox: Obj) -> tuple[Behaviour, str]:
        meta = sandbox["metadata"]
        with self._lock:
            found = self._overrides.get((meta["namespace"], meta["name"])) or \
                self._overrides.get((meta["namespace"], None))
        if found:
            return found
        hooked = self.behaviour_hook(sandbox) if self.behaviour_hook else None
        if hooked:
            return hooked, "simulated pod failure"
        return ("normal" if self.create_pods else "never-ready"), ""

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> SandboxController:
        self._worker = threading.Thread(target=self._work, name="sandbox-controller", daemon=True)
        self._worker.start()
        self.sandboxes.start()
        self.pods.start()
        for informer in (self.sandboxes, self.pods):
            if not informer.synced.wait(30):
                raise TimeoutError(f"sandbox controller: {informer.name} list did not complete")
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.sandboxes.stop()
        self.pods.stop()
        with self._lock:
            for timer in self._timers:
                timer.cancel()
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(10)

    def __enter__(self) -> SandboxController:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- events ---------------------------------------------------------------------------
    def _on_sandbox(self, kind: str, sandbox: Obj) -> None:
        self._queue.put(obj_key(sandbox))

    def _on_pod(self, kind: str, pod: Obj) -> None:
        meta = pod["metadata"]
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("controller"):
                self._queue.put(f"{meta['namespace']}/{ref['name']}")

    def _requeue_at(self, key: str, when: float) -> None:
        def fire() -> None:
            with self._lock:
                self._timers.discard(timer)
            self._queue.put(key)
        timer = threading.Timer(max(0.0, when - time.time()) + 0.05, fire)
        timer.daemon = True
        with self._lock:
            self._timers.add(timer)
        timer.start()

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            if key is None or self._stopping.is_set():
                return
            try:
                with self._reconciling:
                    self.reconcile(key)
            except client.ApiException as exc:
                if exc.status in (404, 409):
                    continue
                log.warning("sandbox controller: %s: API error %s", key, exc.status)
                self._requeue_at(key, time.time() + 0.5)
            except Exception:
                log.exception("sandbox controller: reconcile %s failed", key)

    # -- reconcile ------------------------------------------------------------------------
    def reconcile(self, key: str) -> None:
        sandbox = self.sandboxes.get(key)
        if sandbox is None or sandbox["metadata"].get("deletionTimestamp"):
            return
        if self._behaviour(sandbox)[0] == "frozen":
            return
        self.reconciles += 1
        meta, spec = sandbox["metadata"], sandbox.get("spec") or {}
        namespace, name = meta["namespace"], meta["name"]
        generation = int(meta.get("generation", 1))
        pod_name = (meta.get("annotations") or {}).get(POD_NAME_ANNOTATION) or name
        status: Obj = {"selector": f"{NAME_HASH_LABEL}={name_hash(name)}"}
        shutdown = spec.get("shutdownTime")
        if shutdown and _parse_time(shutdown) <= time.time():
            self._delete_pod(namespace, pod_name)
            if spec.get("shutdownPolicy") == "Delete":
                self.custom.delete_namespaced_custom_object(
                    GROUP, self.version, namespace, PLURAL, name,
                    body=client.V1DeleteOptions(propagation_policy="Background"),
                    _preload_content=False)
                return
            status["conditions"] = [_condition("Ready", False, "SandboxExpired",
                                               "Sandbox has expired", generation)]
            self._write_status(sandbox, status)
            return
        if shutdown:
            self._requeue_at(key, _parse_time(shutdown))
        pod = self._read_pod(namespace, pod_name)
        if spec.get("replicas") == 0 or spec.get("operatingMode") == "Suspended":
            if pod is not None:
                self._delete_pod(namespace, pod_name)
            terminated = pod is None
            status["conditions"] = [
                _condition("Ready", False, "SandboxSuspended", "Sandbox is suspended", generation),
                _condition("Suspended", True,
                           "PodTerminated" if terminated else "PodNotTerminated",
                           "Pod is terminated" if terminated else "Pod is terminating",
                           generation)]
            self._write_status(sandbox, status)
            return
        behaviour, message = self._behaviour(sandbox)
        if behaviour == "failed":
            status["conditions"] = [_condition("Ready", False, "PodFailed", message, generation),
                                    _condition("Finished", True, "PodFailed", message, generation)]
            self._write_status(sandbox, status)
            return
        if pod is None and behaviour == "normal":
            try:
                pod = self._create_pod(sandbox, pod_name)
            except client.ApiException as exc:
                if exc.status is None or not 400 <= exc.status < 500 or exc.status == 409:
                    raise
                status["conditions"] = [_condition("Ready", False, "ReconcilerError",
                                                   f"creating the pod failed: {exc.body}",
                                                   generation)]
                self._write_status(sandbox, status)
                return
        status["conditions"] = self._pod_conditions(pod, generation)
        if pod is not None:
            pod_status = pod.get("status") or {}
            ips = [ip["ip"] for ip in pod_status.get("podIPs") or [] if ip.get("ip")]
            if ips:
                status["podIPs"] = ips
            if pod["spec"].get("nodeName"):
                status["nodeName"] = pod["spec"]["nodeName"]
        self._write_status(sandbox, status)

    def _pod_conditions(self, pod: Obj | None, generation: int) -> list[Obj]:
        if pod is None:
            return [_condition("Ready", False, "DependenciesNotReady", "Pod does not exist",
                               generation)]
        pod_status = pod.get("status") or {}
        phase = pod_status.get("phase", "Pending")
        if phase in ("Succeeded", "Failed"):
            reason = f"Pod{phase}"
            message = f"Pod {phase.lower()}"
            return [_condition("Ready", False, reason, message, generation),
                    _condition("Finished", True, reason, message, generation)]
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in pod_status.get("conditions") or [])
        if phase == "Running" and ready and not pod["metadata"].get("deletionTimestamp"):
            return [_condition("Ready", True, "DependenciesReady", "Pod is Ready", generation)]
        return [_condition("Ready", False, "DependenciesNotReady",
                           f"Pod exists with phase: {phase}", generation)]

    # -- writes ---------------------------------------------------------------------------
    def _read_pod(self, namespace: str, name: str) -> Obj | None:
        try:
            response = self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return k8s_json.read_json(response)

    def _delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def _create_pod(self, sandbox: Obj, pod_name: str) -> Obj:
        meta, spec = sandbox["metadata"], sandbox.get("spec") or {}
        template = spec.get("podTemplate") or {}
        template_meta = template.get("metadata") or {}
        labels = {**(template_meta.get("labels") or {}), NAME_HASH_LABEL: name_hash(meta["name"])}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": pod_name, "namespace": meta["namespace"], "labels": labels,
                "annotations": dict(template_meta.get("annotations") or {}),
                "ownerReferences": [{
                    "apiVersion": f"{GROUP}/{self.version}", "kind": KIND, "name": meta["name"],
                    "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": template.get("spec") or {},
        }
        response = self.core.create_namespaced_pod(meta["namespace"], k8s_json.body(pod),
                                                   _preload_content=False)
        return k8s_json.read_json(response)

    def _write_status(self, sandbox: Obj, status: Obj) -> None:
        old = sandbox.get("status") or {}
        old_conditions = {c.get("type"): c for c in old.get("conditions") or []}
        for cond in status.get("conditions", []):
            previous = old_conditions.get(cond["type"])
            same = previous is not None and previous.get("status") == cond["status"]
            cond["lastTransitionTime"] = (previous or {}).get("lastTransitionTime") if same \
                else _now()
        if _comparable(old) == _comparable(status):
            return
        meta = sandbox["metadata"]
        body: dict[str, Any] = {"status": {
            "conditions": None, "podIPs": None, "nodeName": None, **status}}
        self.custom.patch_namespaced_custom_object_status(
            GROUP, self.version, meta["namespace"], PLURAL, meta["name"], body,
            _content_type="application/merge-patch+json", _preload_content=False)


def _comparable(status: Obj) -> str:
    return json.dumps({k: v for k, v in status.items() if v is not None}, sort_keys=True)
