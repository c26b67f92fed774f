"""Owns what the kubelet simulator gives a pod that runs as its ServiceAccount: the token
files a kubelet mounts (``token``, ``ca.crt``, ``namespace`` from the ServiceAccount's token
Secret, which the controller-manager's token controller creates) and the command wrapper that
shows them at the fixed in-cluster path, so ``load_incluster_config`` works unchanged.

The wrapper runs the pod's command in its own mount and UTS namespaces (``unshare``; needs
root): ``/run`` becomes an overlay whose upper layer is in the pod's directory, the token
directory is bind-mounted at ``/var/run/secrets/kubernetes.io/serviceaccount`` and the
hostname is the pod's name, as in a container. Nothing on the host changes; the process
keeps its pid (``unshare`` and ``sh`` exec), so the simulator signals it as before.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.cluster.pod_env import ConfigError

Obj = dict[str, Any]
RUN_DIR = Path("/var/run").resolve()
TOKEN_DIR = RUN_DIR / "secrets" / "kubernetes.io" / "serviceaccount"
TOKEN_TYPE = "kubernetes.io/service-account-token"
# $1 pod dir, $2 hostname, then the command. /run gets an overlay only when the mount
# point is missing (it is on a host that is no node).
_WRAPPER = f"""set -e
if [ ! -d {TOKEN_DIR} ]; then
  mkdir -p "$1/run-upper" "$1/run-work"
  mount -t overlay overlay -o "lowerdir={RUN_DIR},upperdir=$1/run-upper,workdir=$1/run-work" \\
    {RUN_DIR}
  mkdir -p {TOKEN_DIR}
fi
mount --bind "$1/serviceaccount" {TOKEN_DIR}
hostname "$2"
shift 2
exec "$@"
"""


def service_account(pod_spec: Obj) -> str | None:
    """The ServiceAccount whose token the pod gets, or None (none named, or automount off)."""
    name = pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
    if not name or pod_spec.get("automountServiceAccountToken") is False:
        return None
    return str(name)


def token_files(core: client.CoreV1Api, namespace: str, account: str) -> dict[str, bytes]:
    """``token``, ``ca.crt`` and ``namespace`` of the account's token Secret.
    Raises ConfigError while the account or its token Secret does not exist yet."""
    try:
        sa = core.read_namespaced_service_account(account, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            raise ConfigError(f'serviceaccount "{account}" not found') from exc
        raise
    for name in [ref.name for ref in sa.secrets or [] if ref.name]:
        try:
            secret = core.read_namespaced_secret(name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                continue
            raise
        data = secret.data or {}
        if secret.type == TOKEN_TYPE and {"token", "ca.crt", "namespace"} <= data.keys():
            return {key: base64.b64decode(data[key]) for key in ("token", "ca.crt", "namespace")}
    raise ConfigError(f'serviceaccount "{account}" has no token Secret yet')


def wrap(command: list[str], pod_dir: Path, hostname: str, files: dict[str, bytes]) -> list[str]:
    """Write the token files under ``pod_dir`` and return ``command`` wrapped to see them."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise ConfigError("a ServiceAccount token needs root and unshare (util-linux)")
    token_dir = pod_dir / "serviceaccount"
    token_dir.mkdir(mode=0o755, exist_ok=True)
    for name, content in files.items():
        (token_dir / name).write_bytes(content)
        (token_dir / name).chmod(0o644)
    return ["unshare", "--mount", "--uts", "--propagation", "private", "--",
            "sh", "-c", _WRAPPER, "sh", str(pod_dir), hostname, *command]
