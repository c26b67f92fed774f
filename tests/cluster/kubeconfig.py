"""Owns kubeconfig files of the cluster harness: writing one for a server URL, a CA file and a
bearer token, and building an official-client ``ApiClient`` from such a file."""

from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes import client, config


def write_kubeconfig(
    path: Path,
    server: str,
    token: str,
    ca_file: Path | None,
    user: str = "user",
    namespace: str = "default",
) -> Path:
    """Write a single-context kubeconfig; TLS is verified with ``ca_file`` when given."""
    cluster: dict[str, object] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority"] = str(ca_file)
    else:
        cluster["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "leasekeeper-test", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": f"leasekeeper-test-{user}",
                "context": {"cluster": "leasekeeper-test", "user": user, "namespace": namespace},
            }
        ],
        "current-context": f"leasekeeper-test-{user}",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


def api_client_from_kubeconfig(path: Path | str) -> client.ApiClient:
    """A new ``ApiClient`` for the kubeconfig at ``path`` (the global config is not touched)."""
    api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(path))
    return api
