"""Owns the kubelet simulator's private view of a pod: its own mount and UTS namespaces, in
which its volumes appear at their mount paths, and the way into them for an exec.

What a pod that runs as its ServiceAccount gets: the token files a kubelet mounts (``token``,
``ca.crt``, ``namespace`` from the ServiceAccount's token Secret, which the
controller-manager's token controller creates), read-only at the fixed in-cluster path, so
``load_incluster_config`` works unchanged. Its emptyDir volumes come from pod_volumes.py.

``wrap`` runs the pod's command in its own mount and UTS namespaces (``unshare``; needs root):
each mount's target is bind-mounted from its host directory; a target missing on the host is
created inside an overlay of its nearest existing parent (``/run`` for both the token path and
``/run/leasekeeper``), whose upper layer is in the pod's directory; the hostname is the pod's
name, as in a container. Nothing on the host changes; the process keeps its pid (``unshare``
and ``sh`` exec), so the simulator signals it as before. ``enter`` runs an exec's command in
those same namespaces (``nsenter``), so it sees, and writes into, that pod's volumes alone.
"""

from __future__ import annotations

import base64
import os
import select
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client

from tests.cluster.pod_env import ConfigError
from tests.cluster.pod_volumes import Mount

Obj = dict[str, Any]
RUN_DIR = Path("/var/run").resolve()
TOKEN_DIR = RUN_DIR / "secrets" / "kubernetes.io" / "serviceaccount"
TOKEN_TYPE = "kubernetes.io/service-account-token"
# With this variable set, the wrapper's stdin is a pipe to the simulator: it writes "ready"
# there once the pod's mounts are in place, then gives the pod's command /dev/null as stdin
# (and an environment without the variable). dash takes only one-digit descriptors in
# redirections, so the pipe comes in as descriptor 0.
READY_ENV = "LK_SIM_READY_ON_STDIN"


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


def token_mount(pod_dir: Path, files: dict[str, bytes]) -> Mount:
    """Write the token files under ``pod_dir``; the mount that shows them (read-only) at the
    in-cluster path."""
    token_dir = pod_dir / "serviceaccount"
    token_dir.mkdir(mode=0o755, exist_ok=True)
    for name, content in files.items():
        (token_dir / name).write_bytes(content)
        (token_dir / name).chmod(0o644)
    return Mount(token_dir, str(TOKEN_DIR), read_only=True)


def _existing_parent(target: PurePosixPath) -> Path:
    """The nearest parent of ``target`` that exists on the host, symlinks resolved."""
    for parent in target.parents:
        if Path(parent).is_dir():
            return Path(parent).resolve()
    return Path("/")


def _setup_script(pod_dir: Path, mounts: Sequence[Mount]) -> list[str]:
    """Shell lines that make every mount visible at its target, run in the new namespace."""
    targets = sorted(mounts, key=lambda m: m.target)
    missing = [PurePosixPath(m.target) for m in targets if not Path(m.target).exists()]
    # a target inside another mount's target is created in that volume, as runc does
    outer = [t for t in missing
             if not any(t != PurePosixPath(m.target) and t.is_relative_to(m.target)
                        for m in targets)]
    parents = sorted({_existing_parent(t) for t in outer}, key=lambda p: len(p.parts))
    overlays: list[Path] = []
    for parent in parents:
        if parent == Path("/"):
            raise ConfigError("kubelet simulator: cannot create a mount point under / "
                              "(no parent directory on the host to overlay)")
        if not any(parent.is_relative_to(done) for done in overlays):
            overlays.append(parent)
    lines = []
    for index, parent in enumerate(overlays):
        upper, work = pod_dir / f"overlay-{index}" / "upper", pod_dir / f"overlay-{index}" / "work"
        options = f"lowerdir={parent},upperdir={upper},workdir={work}"
        lines += [f"mkdir -p {shlex.quote(str(upper))} {shlex.quote(str(work))}",
                  f"mount -t overlay overlay -o {shlex.quote(options)} {shlex.quote(str(parent))}"]
    for mount in targets:
        target = shlex.quote(mount.target)
        lines += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(mount.source))} {target}"]
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    return lines


def wrap(command: list[str], pod_dir: Path, hostname: str, mounts: Sequence[Mount]) -> list[str]:
    """``command`` wrapped to run in the pod's own mount and UTS namespaces, seeing
    ``mounts`` at their targets and ``hostname`` as its host name."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise ConfigError("a pod's own namespaces (a ServiceAccount token, volumes) need root "
                          "and unshare (util-linux)")
    ready = (f'if [ -n "${{{READY_ENV}:-}}" ]; then unset {READY_ENV}; printf ready >&0; '
             "exec </dev/null; fi")
    script = "\n".join(["set -e", *_setup_script(pod_dir, mounts), 'hostname "$1"', "shift",
                        ready, 'exec "$@"'])
    return ["unshare", "--mount", "--uts", "--propagation", "private", "--",
            "sh", "-c", script, "sh", hostname, *command]


def await_ready(fd: int, timeout_s: float) -> bool:
    """Whether the wrapper reported its set-up done on ``fd`` within ``timeout_s`` (False: it
    failed, closing the pipe without a word, or is stuck). Closes ``fd``."""
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable) and os.read(fd, 16) == b"ready"
    finally:
        os.close(fd)


def enter(pid: int, command: list[str]) -> list[str]:
    """``command`` run inside the mount and UTS namespaces of process ``pid`` (an exec into
    a pod whose process it is)."""
    return ["nsenter", f"--target={pid}", "--mount", "--uts", "--", *command]


def root_of(pid: int) -> Path:
    """The root directory as process ``pid`` sees it (its mount namespace's view)."""
    return Path(f"/proc/{pid}/root")
