"""Owns a pod's volumes in the kubelet simulator, as a kubelet lays them out: each ``emptyDir``
is a directory of the pod's own (``<pod dir>/volumes/kubernetes.io~empty-dir/<name>``, mode
0777), created before its containers start and removed when the pod object goes; one with
``medium: Memory`` is a tmpfs mounted there (``size`` = its ``sizeLimit``, so a write past the
limit fails with ENOSPC, as with the SizeMemoryBackedVolumes behaviour of kubelets since 1.22).
``mounts(container, volumes)`` says where the container sees each one; pod_namespaces.py
bind-mounts them there in the pod's private mount namespace, so a path such as
``/run/leasekeeper`` shows that pod's volume inside that pod, another pod's inside another,
and nothing on the host.

Only ``emptyDir`` is simulated: a container that mounts any other kind of volume is refused
(``UnsupportedVolume``: the pod waits with ``CreateContainerError``) rather than started
without it. Needs root (mount), as the mount namespaces do.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.pod_env import ConfigError

Obj = dict[str, Any]
EMPTY_DIR = "kubernetes.io~empty-dir"
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
            "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
            "Ei": 2**60}


class UnsupportedVolume(Exception):
    """The container mounts a kind of volume the simulator does not provide."""


@dataclass(frozen=True)
class Mount:
    """``source`` (a host path) shown at ``target`` inside the container."""

    source: Path
    target: str
    read_only: bool = False


def quantity_bytes(raw: str) -> int:
    """A Kubernetes quantity (``4Mi``, ``1G``, ``512``) in bytes, rounded up."""
    match = _QUANTITY.match(raw.strip())
    if not match:
        raise ConfigError(f"kubelet simulator: cannot read the quantity {raw!r}")
    number, suffix = match.groups()
    whole, _, fraction = number.partition(".")
    factor = _FACTORS[suffix]
    value = int(whole) * factor
    if fraction:
        value += -(-int(fraction) * factor // 10 ** len(fraction))
    return value


def volumes_dir(pod_dir: Path) -> Path:
    return pod_dir / "volumes"


def prepare(pod_spec: Obj, pod_dir: Path) -> dict[str, Path]:
    """The host directory of each emptyDir volume of the pod, created (and for medium
    Memory, a tmpfs mounted on it) if not there yet. Other kinds are left out."""
    found: dict[str, Path] = {}
    for volume in pod_spec.get("volumes") or []:
        empty = volume.get("emptyDir")
        if empty is None:
            continue
        path = volumes_dir(pod_dir) / EMPTY_DIR / volume["name"]
        path.mkdir(parents=True, exist_ok=True)
        if empty.get("medium") == "Memory" and not os.path.ismount(path):
            if os.geteuid() != 0:
                raise ConfigError("kubelet simulator: a memory-backed emptyDir needs root")
            options = "mode=0777"
            if empty.get("sizeLimit"):
                options += f",size={quantity_bytes(str(empty['sizeLimit']))}"
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                           check=True, capture_output=True, timeout=30)
        path.chmod(0o777)
        found[volume["name"]] = path
    return found


def mounts(container: Obj, pod_spec: Obj, volumes: dict[str, Path]) -> list[Mount]:
    """Where ``container`` sees its volumes. Raises UnsupportedVolume for a mount of a
    volume that is not an emptyDir (a ServiceAccount token is pod_namespaces.py's)."""
    kinds = {v["name"]: next((k for k in v if k != "name"), "?")
             for v in pod_spec.get("volumes") or []}
    found = []
    for mount in container.get("volumeMounts") or []:
        name = mount["name"]
        if name not in volumes:
            raise UnsupportedVolume(
                f"kubelet simulator: volume {name!r} ({kinds.get(name, 'undeclared')}) is not "
                "simulated; only emptyDir volumes are")
        source = volumes[name]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            source.mkdir(parents=True, exist_ok=True)
        found.append(Mount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    return found


def remove(pod_dir: Path) -> None:
    """Unmount and delete the pod's volumes (the pod object is gone)."""
    root = volumes_dir(pod_dir)
    if not root.exists():
        return
    for path in sorted(root.glob("*/*"), reverse=True):
        if os.path.ismount(path):
            done = subprocess.run(["umount", str(path)], capture_output=True, check=False,
                                  timeout=30)
            if done.returncode != 0:  # busy: detach it now, the kernel frees it when unused
                subprocess.run(["umount", "--lazy", str(path)], capture_output=True,
                               check=False, timeout=30)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(root)
