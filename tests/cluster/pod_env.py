"""Owns turning a pod's container spec into a local process's command and environment, as a
kubelet would: ``env`` (values, ``$(VAR)`` expansion, secretKeyRef, configMapKeyRef, fieldRef)
and ``envFrom`` (secretRef, configMapRef, prefix), reading Secrets and ConfigMaps from the API."""

from __future__ import annotations

import base64
import re
from typing import Any

from kubernetes import client

Obj = dict[str, Any]
IDLE_COMMAND = ["sleep", "infinity"]
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class ConfigError(Exception):
    """A referenced Secret / ConfigMap / key is missing (kubelet: CreateContainerConfigError)."""


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion; ``$$`` escapes; unknown references stay as written."""
    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))
    return _REF.sub(repl, value)


def container_command(container: Obj, env: dict[str, str]) -> list[str]:
    command = [expand(c, env) for c in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    argv = command + args
    return argv or list(IDLE_COMMAND)


class EnvResolver:
    """Reads Secrets and ConfigMaps of the pod's namespace through the API."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)

    def _data(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str] | None:
        try:
            if kind == "secret":
                secret = self.core.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v).decode(errors="replace")
                        for k, v in (secret.data or {}).items()}
            config_map = self.core.read_namespaced_config_map(name, namespace)
            return dict(config_map.data or {})
        except client.ApiException as exc:
            if exc.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind} "{name}" not found') from exc
            raise

    def environment(self, pod: Obj, container: Obj, base: dict[str, str]) -> dict[str, str]:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
        namespace = meta["namespace"]
        env = dict(base)
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for kind in ("secret", "configMap"):
                ref = source.get(f"{kind}Ref")
                if ref:
                    data = self._data(kind.lower(), namespace,
                                      ref["name"], bool(ref.get("optional")))
                    env.update({prefix + k: v for k, v in (data or {}).items()})
        fields = {
            "metadata.name": meta["name"], "metadata.namespace": namespace,
            "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": status.get("podIP") or "127.0.0.1",
            "status.hostIP": status.get("hostIP") or "127.0.0.1",
        }
        for var in container.get("env") or []:
            name, source = var["name"], var.get("valueFrom")
            if source is None:
                env[name] = expand(var.get("value", ""), env)
                continue
            value = self._value_from(namespace, meta, fields, source)
            if value is not None:
                env[name] = value
        return env

    def _value_from(self, namespace: str, meta: Obj, fields: dict[str, str],
                    source: Obj) -> str | None:
        for kind, field in (("secret", "secretKeyRef"), ("configmap", "configMapKeyRef")):
            ref = source.get(field)
            if ref:
                optional = bool(ref.get("optional"))
                data = self._data(kind, namespace, ref["name"], optional)
                if data is None:
                    return None
                if ref["key"] not in data:
                    if optional:
                        return None
                    raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} '
                                      f'{namespace}/{ref["name"]}')
                return data[ref["key"]]
        field_ref = source.get("fieldRef")
        if field_ref:
            path = field_ref["fieldPath"]
            match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if match:
                return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
            return fields.get(path, "")
        return None
