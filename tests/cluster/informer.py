"""Owns the list+watch loop (a tiny informer) shared by the harness simulators: lists, watches
from the list's resourceVersion, resumes from the last seen resourceVersion when a watch ends or
breaks, relists on 410 Gone, keeps a cache of objects (plain JSON dicts) and can be stopped at
once (the open watch response is shut down)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Handler = Callable[[str, Obj], None]


def obj_key(obj: Obj) -> str:
    meta = obj.get("metadata", {})
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class Informer:
    """Calls ``handler(event_type, obj)`` for ADDED / MODIFIED / DELETED, from one thread.

    ``list_call`` is a generated client method such as ``CoreV1Api.list_pod_for_all_namespaces``
    (or a ``functools.partial`` of ``CustomObjectsApi.list_cluster_custom_object``).
    """

    def __init__(self, name: str, list_call: Callable[..., Any], handler: Handler,
                 label_selector: str | None = None, watch_timeout: int = 240) -> None:
        self.name = name
        self._list_call = list_call
        self._handler = handler
        self._selector = label_selector
        self._watch_timeout = watch_timeout
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._cache: dict[str, Obj] = {}
        self._thread: threading.Thread | None = None
        self._rv: str | None = None
        self.synced = threading.Event()
        self.relists = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()
        if self._thread is not None:
            self._thread.join(10)

    def get(self, key: str) -> Obj | None:
        with self._lock:
            return self._cache.get(key)

    def items(self) -> list[Obj]:
        with self._lock:
            return list(self._cache.values())

    # -- loop -----------------------------------------------------------------------------
    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self._selector} if self._selector else {}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._rv is None:
                    self._rv = self._relist()
                self._watch()
            except ApiException as exc:
                if exc.status == 410:
                    self._rv = None
                    continue
                log.warning("%s: watch failed: %s", self.name, exc)
                self._stop.wait(0.5)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.debug("%s: watch broke: %s", self.name, exc)
                self._stop.wait(0.2)

    def _relist(self) -> str:
        response = self._list_call(_preload_content=False, **self._kwargs())
        body = json.loads(response.data)
        self.relists += 1
        fresh = {obj_key(item): item for item in body.get("items", [])}
        with self._lock:
            gone = [obj for key, obj in self._cache.items() if key not in fresh]
            self._cache = dict(fresh)
        for obj in gone:
            self._dispatch("DELETED", obj)
        for obj in fresh.values():
            self._dispatch("ADDED", obj)
        self.synced.set()
        return str(body["metadata"]["resourceVersion"])

    def _watch(self) -> None:
        response = self._list_call(
            watch=True, resource_version=self._rv, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout, _preload_content=False, **self._kwargs())
        with self._lock:
            self._response = response
        try:
            buffer = b""
            for chunk in response.stream(65536, decode_content=False):
                if self._stop.is_set():
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        self._rv = self._event(json.loads(line))
                        if self._rv is None:
                            return
        finally:
            with self._lock:
                self._response = None
            response.release_conn()

    def _event(self, event: Obj) -> str | None:
        """Handle one watch event; returns the resourceVersion to resume from (None: relist)."""
        kind, obj = event.get("type"), event.get("object", {})
        if kind == "ERROR":
            if obj.get("code") == 410:
                return None
            raise RuntimeError(f"watch error: {obj}")
        rv = str(obj.get("metadata", {}).get("resourceVersion", ""))
        if kind == "BOOKMARK":
            return rv
        key = obj_key(obj)
        with self._lock:
            if kind == "DELETED":
                self._cache.pop(key, None)
            else:
                self._cache[key] = obj
        self._dispatch(str(kind), obj)
        return rv

    def _dispatch(self, kind: str, obj: Obj) -> None:
        try:
            self._handler(kind, obj)
        except Exception:
            log.exception("%s: handler failed for %s %s", self.name, kind, obj_key(obj))
