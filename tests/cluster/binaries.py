"""Owns locating the kube-apiserver / kube-controller-manager binaries for the harness:
``LEASEKEEPER_KUBE_BIN_DIR`` if set, else ``build.sh`` (which returns the cache at once when
the binaries were built before, and builds them from Debian's source package otherwise)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build.sh")
BINARIES = ("kube-apiserver", "kube-controller-manager")


class BinariesUnavailable(RuntimeError):
    """The binaries are neither cached nor buildable on this machine."""


def _check(bin_dir: Path) -> Path:
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise BinariesUnavailable(f"{', '.join(missing)} missing or not executable in {bin_dir}")
    return bin_dir


def locate_binaries(build_timeout: float = 1800.0) -> Path:
    """The directory holding both binaries, building them if needed (about 6 minutes cold)."""
    override = os.environ.get("LEASEKEEPER_KUBE_BIN_DIR")
    if override:
        return _check(Path(override))
    try:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True,
            timeout=build_timeout, check=False, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise BinariesUnavailable(f"{BUILD_SCRIPT} timed out after {build_timeout:.0f}s") from exc
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = "\n".join(result.stderr.strip().splitlines()[-30:])
        raise BinariesUnavailable(
            f"{BUILD_SCRIPT} failed with exit code {result.returncode}; stderr tail:\n{tail}")
    return _check(Path(lines[-1]))
