"""Owns the waiting helpers for cluster tests: wait for an object to satisfy a predicate by
reading it once and then watching from its resourceVersion, against a monotonic deadline (no
fixed sleeps). Works for any list call of the generated client, with ``_preload_content=False``
so objects are plain JSON dicts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client

Obj = dict[str, Any]


def wait_for_object(list_call: Callable[..., Any], name: str,
                    predicate: Callable[[Obj | None], bool], timeout: float = 30.0,
                    what: str | None = None, **kwargs: Any) -> Obj | None:
    """Wait until the object ``name`` from ``list_call(**kwargs)`` satisfies ``predicate``.

    ``predicate`` gets the object, or None while (or once) it does not exist, so it can wait
    for deletion too. Returns the last object seen. Raises TimeoutError with the last state.
    """
    deadline = time.monotonic() + timeout
    selector = f"metadata.name={name}"
    last: Obj | None = None
    while True:
        response = list_call(field_selector=selector, _preload_content=False, **kwargs)
        body = json.loads(response.data)
        items = body.get("items", [])
        last = items[0] if items else None
        if predicate(last):
            return last
        rv = body["metadata"]["resourceVersion"]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            stream = list_call(field_selector=selector, watch=True, resource_version=rv,
                               timeout_seconds=max(1, int(remaining)), _preload_content=False,
                               _request_timeout=remaining + 5, **kwargs)
            for line in stream:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    break  # expired resourceVersion: list again
                if event["type"] == "BOOKMARK":
                    continue
                last = None if event["type"] == "DELETED" else event["object"]
                if predicate(last):
                    _discard(stream)
                    return last
                if time.monotonic() >= deadline:
                    break
            _discard(stream)
        except client.ApiException as exc:
            if exc.status != 410:
                raise
        if time.monotonic() >= deadline:
            break
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what or name}; "
                       f"last state: {json.dumps(last)[:2000] if last else 'absent'}")


def _discard(stream: Any) -> None:
    """Close a watch response; its connection must not go back to the pool half-read."""
    stream.close()
    stream.release_conn()


def wait_for_pod(core: client.CoreV1Api, namespace: str, name: str,
                 predicate: Callable[[Obj | None], bool], timeout: float = 30.0) -> Obj | None:
    return wait_for_object(core.list_namespaced_pod, name, predicate, timeout,
                           f"pod {namespace}/{name}", namespace=namespace)


def pod_phase_in(*phases: str) -> Callable[[Obj | None], bool]:
    return lambda pod: pod is not None and pod.get("status", {}).get("phase") in phases


def condition_is(kind: str, status: str = "True") -> Callable[[Obj | None], bool]:
    """Predicate: ``status.conditions[type=kind].status == status``."""
    def check(obj: Obj | None) -> bool:
        conditions = (obj or {}).get("status", {}).get("conditions") or []
        return any(c.get("type") == kind and c.get("status") == status for c in conditions)
    return check


def gone(obj: Obj | None) -> bool:
    return obj is None
