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
from collections.abc import Iterator, Mapping
from pathlib import Path

from providers.errors import ConfigError

LOCK_NAME = "up.lock"
# As `db upgrade` words it for the store's folder (workers/preflight.py: migrate).
VAR_DIR_FIX = "point LEASEKEEPER_VAR_DIR at a directory this user can write"


@contextlib.contextmanager
def hold_var_dir(var_dir: Path) -> Iterator[Path]:
    """Hold the var dir's lock while the block runs; ConfigError if another `up` holds it,
    or if the var dir cannot be made or written (one line, as `db upgrade` says it)."""
    var = var_dir.resolve()
    path = var / LOCK_NAME
    probe = var / f".up-probe-{os.getpid()}"
    if var.exists() and not var.is_dir():
        raise ConfigError(f"cannot use the var dir {var}: it is not a folder; "
                          f"{VAR_DIR_FIX}")
    try:
        var.mkdir(parents=True, exist_ok=True)
        # The lock file may be there from an earlier `up` while the folder no longer takes
        # new files (read-only, immutable), and `up` writes its env file and logs there.
        probe.touch()
        probe.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        where = ("no file can be created in it" if exc.filename == str(probe) else
                 exc.filename)
        raise ConfigError(f"cannot use the var dir {var}: {exc.strerror or exc}"
                          f"{f' ({where})' if where else ''}; {VAR_DIR_FIX}") from None
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


def running_up(var_dir: Path) -> int | None:
    """The pid of the `leasekeeper up` running on ``var_dir``, None if none is: the pid it
    wrote into its lock file (emptied when it stops) and a process with that pid alive.
    Read only, never locked: a check must not make an `up` starting meanwhile fail."""
    try:
        text = (var_dir / LOCK_NAME).read_text(errors="replace").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    pid = int(text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # killed outright (SIGKILL, a reboot): its env file is stale
    except PermissionError:
        pass  # alive, another user's
    return pid


def broker_hint(env: Mapping[str, str], env_file: Path) -> str:
    """Where an unreachable broker's URL came from, when that says what to do: the env
    file of an `up` that no longer runs (killed, or the machine rebooted), or no
    setting at all (the default address, where nothing may ever have run). "" when the
    URL was set in the environment."""
    if env.get("LEASEKEEPER_BROKER_URL"):
        return ""
    try:
        from_file = "LEASEKEEPER_BROKER_URL=" in env_file.read_text(errors="replace")
    except OSError:
        from_file = False
    if not from_file:
        return (" LEASEKEEPER_BROKER_URL is not set, so this is the default address: "
                "`leasekeeper up` (`make run` in a checkout) starts a broker with the whole "
                "backend and writes its address for clients here")
    if running_up(env_file.parent) is not None:
        return ""
    return (f" The URL comes from {env_file}, written by a `leasekeeper up` that is no "
            "longer running (killed, or the machine restarted): start `leasekeeper up` "
            f"again, or remove {env_file} and set LEASEKEEPER_BROKER_URL")
