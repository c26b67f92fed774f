"""One `leasekeeper up` per var dir: an exclusive flock on ``$LEASEKEEPER_VAR_DIR/up.lock``,
held for `up`'s whole life (the kernel releases it when the process ends, however it ends).

A second `up` on the same var dir would start a second backend on the first one's store and
overwrite its env file and Flower credentials, so the first, still running, could no longer
be found. It is refused at once instead, naming the running one's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from providers.errors import ConfigError

LOCK_NAME = "up.lock"


@contextlib.contextmanager
def hold_var_dir(var_dir: Path) -> Iterator[Path]:
    """Hold the var dir's lock while the block runs; ConfigError if another `up` holds it."""
    var = var_dir.resolve()
    var.mkdir(parents=True, exist_ok=True)
    path = var / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"another `leasekeeper up` (pid {holder}) is already running on {var}; "
                f"use that one (its settings are in {var / 'env'}), stop it first (Ctrl-C in "
                f"its terminal, or kill {holder}), or set LEASEKEEPER_VAR_DIR to another "
                "directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # the lock itself goes with the fd
    finally:
        os.close(fd)
