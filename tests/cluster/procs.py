"""Owns process and port helpers of the cluster harness: free loopback ports, child processes
in their own process group with a log file, readiness polling against a monotonic deadline, and
stopping exactly the processes that were started (by pid / process group, never by name)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ManagedProcess:
    """A child process in its own session, with stdout and stderr in ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def pause(self) -> None:
        """SIGSTOP the process group: it does nothing until ``resume``."""
        _signal_group(self.popen.pid, signal.SIGSTOP)

    def resume(self) -> None:
        _signal_group(self.popen.pid, signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it after ``timeout`` seconds."""
        if self.popen.poll() is not None:
            _reap_group(self.popen.pid)
            return
        _signal_group(self.popen.pid, signal.SIGCONT)  # a paused process cannot act on TERM
        _signal_group(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        _reap_group(self.popen.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        pass


def _reap_group(pgid: int) -> None:
    """Kill what is left of a process group whose leader has exited."""
    _signal_group(pgid, signal.SIGKILL)


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.05,
    failed: Callable[[], str | None] | None = None,
) -> None:
    """Poll ``check`` until it returns True or the monotonic deadline passes.

    ``failed`` may return an error text to give up early (for example a process that exited).
    """
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        if check():
            return
        if failed is not None:
            reason = failed()
            if reason:
                raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
