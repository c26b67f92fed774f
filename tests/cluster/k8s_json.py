"""Owns the glue between plain JSON dicts and the typed official client: request bodies given
as dicts, responses read with ``_preload_content=False`` (urllib3 responses) as dicts, and the
client an exec (``kubernetes.stream.stream``) goes through."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

Obj = dict[str, Any]


def body(obj: Obj) -> Any:
    """A dict request body (the client serialises dicts as they are)."""
    return obj


def read_json(response: object) -> Obj:
    """The JSON document of a raw (``_preload_content=False``) response."""
    data: Obj = json.loads(getattr(response, "data", b"") or b"{}")
    return data


def exec_core(api: client.ApiClient) -> client.CoreV1Api:
    """A CoreV1Api for ``stream(core.connect_get_namespaced_pod_exec, ...)``, on a fresh
    ApiClient of ``api``'s configuration: ``stream`` swaps ``call_api`` on the ApiClient it
    is given for the whole exec, so any other thread's request through that ApiClient (the
    kubelet and Sandbox controller simulators share the session's admin client) would go
    out as a WebSocket and fail with status 0."""
    return client.CoreV1Api(client.ApiClient(api.configuration))
