"""Children that die with their parent: how `leasekeeper up` starts each child
(workers/embedded.py), each in a session of its own, so that an `up` killed outright
(SIGKILL, the OOM killer), which cannot stop them itself, leaves none of them running.

On Linux, ``wrapped(argv)`` runs ``argv`` through this module: it asks the kernel for
SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), then execs ``argv``
in its own place (same pid; the setting survives the exec, and Flower's own execve). Each
child then stops as on `up`'s own SIGTERM: the worker's warm shutdown stops its pool,
whose processes Celery already ties to the worker the same way. A parent that died before
the prctl is caught by comparing the parent pid (then nothing is run). A small program of
its own rather than a ``preexec_fn``: nothing runs between fork and exec in a process that
may have threads. Elsewhere ``argv`` runs as it is.

The kernel means the parent *thread*: `up` starts its children from its main thread,
which lives as long as `up` does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
CANNOT_RUN = 127  # the shell's code for a command it cannot run


def wrapped(argv: list[str]) -> list[str]:
    """``argv`` so that it dies with this process (on Linux; elsewhere as it is)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-m", "workers.die_with_parent", str(os.getpid()), *argv]


def main(args: list[str]) -> int:
    """``<parent pid> <argv...>``: exec argv once it dies with that parent."""
    parent, argv = int(args[0]), args[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"cannot run {argv[0]} tied to its parent: prctl(PR_SET_PDEATHSIG): "
              f"{os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return CANNOT_RUN
    if os.getppid() != parent:  # the parent died before the prctl: nobody would stop it
        return 1
    try:
        os.execvp(argv[0], argv)  # noqa: S606 (the argv `up` chose, not a shell)
    except OSError as exc:
        print(f"cannot run {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
    return CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
