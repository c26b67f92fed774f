"""The ``local`` provider: a sandbox is a process group on this machine.

Each lease gets ``<root>/<name>/``: ``lease.json`` (who owns it, pid, process start time),
``work/`` (the sandbox's working directory), ``output.log`` and, when the command ends by
itself, ``exit_code`` (the exit sentinel). A warm pool member also gets ``run/`` (0700),
named to its processes by ``LEASEKEEPER_RUN_DIR`` (providers.base.RUN_DIR_ENV); a claim
fills it with its run's data: ``run.json``, ``env`` (0600) and last ``claimed``, each
written to a temporary file and renamed into place, so a sandbox that waits for
``claimed`` and then sources ``env`` never reads half a file.

The process is started through ``setsid`` so it leads its own process group and outlives
the worker that started it; the recorded start time guards against pid reuse. Every
sandbox process also carries its workspace path in ``LEASEKEEPER_WORKSPACE``, so a process
is found even when its record lost its pid (a worker killed between spawn and record) or
its workspace was deleted behind our back: destroy kills such stragglers too, and
list_managed lists them. Destroy sends SIGTERM to the group, waits on a pidfd up to a
grace period, then SIGKILL, then removes the directory (only once no process is left: the
record is the pointer a retried destroy needs). A per-lease ``flock`` makes acquire, claim
and destroy safe against a redelivered task running beside the original.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from providers.base import (
    RUN_DIR_ENV,
    Acquired,
    AcquireOutcome,
    AcquireRequest,
    Claimed,
    ClaimOutcome,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
    ManagedResource,
    ResumeOutcome,
    ResumeResult,
)
from providers.errors import (
    DestroyIncomplete,
    PartFailure,
    ProviderConflict,
    ProviderError,
    TerminalProviderError,
    TransientProviderError,
    unknown_backend,
)
from providers.spec import SandboxSpec, echo

IDLE_COMMAND = ["sh", "-c", "while :; do sleep 3600; done"]
MARKER = "LEASEKEEPER_WORKSPACE"
# The sandbox leader: runs the command, then writes the exit sentinel.
_WRAPPER = 'cd work && "$@"; echo $? > ../exit_code.tmp && mv ../exit_code.tmp ../exit_code'
_LAUNCH = 'setsid sh -c "$0" lk-sandbox "$@" </dev/null >>output.log 2>&1 & echo $!'


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int


def _start_ticks(pid: int) -> int | None:
    """Process start time in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and ')' : split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _until_group_leader(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until the launched process leads its own group (``setsid`` runs in the
    background job after the launcher printed its pid), or is gone: a destroy or a kill
    of the group right after the acquire then finds the group. No event tells it, so
    this polls /proc, bounded by a monotonic deadline (usually done in a millisecond)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return
        except ProcessLookupError:
            return  # already ended: its exit sentinel tells the outcome
        time.sleep(0.002)


def _group_members(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in the process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _killed(ident: ProcessIdentity | None, alive: bool, code: int | None) -> str | None:
    """Why a started sandbox whose process group is gone left no exit code: its wrapper
    (which writes the code when the command ends) was killed with it (SIGKILL of the
    group, the OOM killer). None while it runs, once it wrote a code, or before it was
    ever started (a workspace being created has no process yet)."""
    if ident is None or alive or code is not None:
        return None
    return killed_reason(ident.pid)


def killed_reason(pid: int) -> str:
    """The stop reason of a sandbox whose process group ended with no exit code written."""
    return f"process {pid} killed"


def _marked_processes(root: Path) -> dict[str, list[int]]:
    """Live processes whose ``LEASEKEEPER_WORKSPACE`` is a workspace under ``root``, by name."""
    found: dict[str, list[int]] = {}
    prefix = f"{MARKER}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(prefix):
                workspace = Path(os.fsdecode(var[len(prefix):]))
                if workspace.parent == root and _start_ticks(int(entry.name)) is not None:
                    found.setdefault(workspace.name, []).append(int(entry.name))
                break
    return found


def _started_at(pid: int) -> datetime | None:
    """When the process started (from its start ticks and the boot time), or None."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    return None


def _alive(ident: ProcessIdentity) -> bool:
    return _start_ticks(ident.pid) == ident.start_ticks


@contextlib.contextmanager
def _translate(part: str) -> Iterator[None]:
    """Map OS errors to the provider exception tree (the one boundary for this adapter)."""
    try:
        yield
    except ProviderError:
        raise
    except PermissionError as exc:
        raise TerminalProviderError(
            f"local {part}: permission denied ({exc.filename or ''}); check that the worker "
            "user owns LEASEKEEPER_LOCAL_ROOT_DIR"
        ) from None
    except FileNotFoundError as exc:
        raise TerminalProviderError(
            f"local {part}: {exc.strerror}: {exc.filename or ''}; is the command installed?"
        ) from None
    except OSError as exc:
        kind = TransientProviderError if exc.errno in _TRANSIENT_ERRNOS else TerminalProviderError
        raise kind(f"local {part}: {exc.strerror or exc}") from None


RUN_DIR = "run"  # a pool member's run directory, under its lease directory
CLAIMED_FILE = "claimed"  # written last by a claim: the run's data is complete


def _sh_quote(value: str) -> str:
    """``value`` in single quotes for sh (a ``'`` becomes ``'"'"'``): sourced, it is the
    exact value, whatever it holds."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write to a fresh temporary file of ``mode`` beside ``path``, then rename it over
    ``path``: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EBUSY,
                               errno.ENOSPC, errno.EINTR})


class LocalProvider:
    name = "local"
    backend = "process"

    def __init__(self, root: Path, installation_id: str, destroy_grace_s: float = 5.0) -> None:
        self.root = root
        self.installation_id = installation_id
        self.destroy_grace_s = destroy_grace_s

    # -- naming and files -------------------------------------------------------------
    def lease_name(self, lease_id: str) -> str:
        return f"lk-{lease_id}"

    def _dir(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise TerminalProviderError(f"local: invalid lease name {name!r}")
        return self.root / name

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / f".{name}.lock"
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _read_record(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads((path / "lease.json").read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _write_record(path: Path, record: dict[str, Any]) -> None:
        tmp = path / "lease.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path / "lease.json")

    @staticmethod
    def _identity(record: dict[str, Any]) -> ProcessIdentity | None:
        pid, ticks = record.get("pid"), record.get("start_ticks")
        if isinstance(pid, int) and isinstance(ticks, int):
            return ProcessIdentity(pid, ticks)
        return None

    # -- contract -----------------------------------------------------------------------
    def check_spec(self, spec: SandboxSpec) -> None:
        """One backend, ``process``; the command must exist: on the sandbox's PATH, or as
        a path to an executable."""
        if spec.backend not in (None, self.backend):
            raise unknown_backend(self.name, spec.backend, self.backend)
        if not spec.command:
            return
        program = spec.command[0]
        path = spec.env.get("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
        found = (os.path.isfile(program) and os.access(program, os.X_OK) if "/" in program
                 else shutil.which(program, path=path) is not None)
        if not found:
            raise TerminalProviderError(
                f"local: command {echo(program)} not found "
                + ("(not an executable file)" if "/" in program else
                   # the worker's own PATH is not quoted: the message is a task result
                   "on the sandbox's PATH (env.PATH)" if "PATH" in spec.env else
                   "on the worker's PATH")
                + "; install it, give its absolute path, or set env.PATH"
            )

    def acquire(self, request: AcquireRequest) -> Acquired:
        with _translate("acquire"), self._locked(request.name):
            path = self._dir(request.name)
            record = self._read_record(path)
            if record is not None and record.get("lease_id") not in (None, request.lease_id):
                raise ProviderConflict(
                    f"local: {path} belongs to lease {record.get('lease_id')!r}, "
                    f"not {request.lease_id!r}; refusing to adopt it"
                )
            ident = self._identity(record or {})
            if ident is not None and _alive(ident):
                return Acquired(AcquireOutcome.ADOPTED, self.backend, self._meta(path, ident))
            if ident is not None:  # a previous attempt started a process that died: clear it
                self._kill_group(ident)
            self._kill_marked(request.name)  # one spawned by an attempt killed before recording
            (path / "work").mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (path / "exit_code").unlink()
            base = {
                "lease_id": request.lease_id,
                "name": request.name,
                "installation": self.installation_id,
                "labels": request.labels,
                "created_at": datetime.now(UTC).isoformat(),
            }
            if request.pool is not None:  # a pool member: where its claim will put the run's data
                (path / RUN_DIR).mkdir(mode=0o700, exist_ok=True)
            self._write_record(path, base)  # the workspace is findable before a process exists
            ident = self._spawn(path, request)
            self._write_record(path, {**base, "pid": ident.pid, "start_ticks": ident.start_ticks})
            return Acquired(AcquireOutcome.CREATED, self.backend, self._meta(path, ident))

    def _spawn(self, path: Path, request: AcquireRequest) -> ProcessIdentity:
        command = list(request.spec.command or IDLE_COMMAND)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(path / "work"),
            "LEASEKEEPER_LEASE_ID": request.lease_id,
            **request.spec.env,
            **request.spec.secret_values(),
            **({RUN_DIR_ENV: str(path / RUN_DIR)} if request.pool is not None else {}),
            MARKER: str(path),
        }
        launcher = subprocess.run(
            ["sh", "-c", _LAUNCH, _WRAPPER, *command],
            cwd=path, env=env, capture_output=True, text=True, timeout=30, check=False,
        )
        if launcher.returncode != 0 or not launcher.stdout.strip().isdigit():
            raise TerminalProviderError(
                f"local: could not start the sandbox process (exit {launcher.returncode}); "
                "see output.log in the lease directory"
            )
        pid = int(launcher.stdout.strip())
        _until_group_leader(pid)
        # A command that already ended is still a sandbox: its exit sentinel tells the
        # outcome. Start time 0 never matches a live process, so nothing is ever killed.
        return ProcessIdentity(pid, _start_ticks(pid) or 0)

    def _meta(self, path: Path, ident: ProcessIdentity) -> dict[str, Any]:
        return {"pid": ident.pid, "start_ticks": ident.start_ticks, "workspace": str(path)}

    def resume_check(self, handle: LeaseHandle, timeout_s: float) -> ResumeResult:
        with _translate("resume check"):
            path = self._dir(handle.name)
            record = self._read_record(path)
            if record is None:
                return ResumeResult.not_resumable("workspace no longer exists")
            ident = self._identity(record)
            if ident is None:
                return ResumeResult.not_resumable("sandbox process was never started")
            ticks = _start_ticks(ident.pid)
            if ticks is None:
                code = self.exit_code(handle)
                suffix = f" with exit code {code}" if code is not None else " (killed)"
                # as list_managed reports it, so the runs' record does not depend on
                # which of sweep.finish_exited and this check noticed first
                return ResumeResult.not_resumable(
                    f"process {ident.pid} exited{suffix}", exit_code=code,
                    exit_reason=killed_reason(ident.pid) if code is None else None)
            if ticks != ident.start_ticks:
                return ResumeResult.not_resumable(
                    f"process {ident.pid} exited and its pid was reused"
                )
            return ResumeResult.resumable(pid=ident.pid, workspace=str(path / "work"))

    def claim(self, handle: LeaseHandle, request: ClaimRequest) -> Claimed:
        """The cheap resume check (is the process alive?), then the run's data into the
        member's run directory: ``run.json``, ``env`` (0600, ``KEY='value'`` lines, env then
        secret_env) and ``claimed`` (the run id), each by atomic rename. Idempotent for the
        same run; a member already claimed by another run is not resumable. Secret values
        go only into ``env``; no error or meta quotes them."""
        with _translate("claim"), self._locked(handle.name):
            check = self.resume_check(handle, request.timeout_s)
            if check.outcome == ResumeOutcome.NOT_RESUMABLE:
                return Claimed(ClaimOutcome.NOT_RESUMABLE, check.reason)
            run_dir = self._dir(handle.name) / RUN_DIR
            if not run_dir.is_dir():
                return Claimed(ClaimOutcome.NOT_RESUMABLE,
                               "not a pool member (it has no run directory)")
            with contextlib.suppress(FileNotFoundError):
                holder = (run_dir / CLAIMED_FILE).read_text().strip()
                if holder != request.run_id:
                    return Claimed(ClaimOutcome.NOT_RESUMABLE,
                                   f"already claimed by run {holder[:128]}")
            record = {"lease_id": request.lease_id, "run_id": request.run_id,
                      "tenant": request.tenant, "labels": request.labels}
            _write_atomically(run_dir / "run.json", json.dumps(record).encode(), 0o600)
            lines = [f"{key}={_sh_quote(value)}\n"
                     for key, value in [*request.env.items(), *request.secret_env.items()]]
            _write_atomically(run_dir / "env", "".join(lines).encode(), 0o600)
            _write_atomically(run_dir / CLAIMED_FILE, f"{request.run_id}\n".encode(), 0o600)
            return Claimed(ClaimOutcome.CLAIMED, meta={"run_dir": str(run_dir)})

    def exit_code(self, handle: LeaseHandle) -> int | None:
        """The exit sentinel: the command's exit code, or None while unknown."""
        try:
            return int((self._dir(handle.name) / "exit_code").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def destroy(self, handle: LeaseHandle) -> DestroyOutcome:
        failures: list[PartFailure] = []
        with self._locked(handle.name):
            path = self._dir(handle.name)
            record = self._read_record(path)
            if record is None and not path.exists() and handle.name not in _marked_processes(
                    self.root):
                return DestroyOutcome.ALREADY_GONE
            ident = self._identity(record or {})
            try:
                with _translate("destroy process"):
                    if ident is not None:
                        self._kill_group(ident)
                    self._kill_marked(handle.name)
            except ProviderError as exc:
                failures.append(PartFailure("process", exc))
            if failures:  # keep the record: a retried destroy needs it to find the process
                failures.append(PartFailure("workspace", TransientProviderError(
                    f"local: kept {path} until its process is gone")))
            elif path.exists():
                try:
                    with _translate("destroy workspace"):
                        shutil.rmtree(path)
                except ProviderError as exc:
                    failures.append(PartFailure("workspace", exc))
        if failures:
            raise DestroyIncomplete.of(handle.name, failures)
        with contextlib.suppress(FileNotFoundError):
            (self.root / f".{handle.name}.lock").unlink()
        return DestroyOutcome.DESTROYED

    def _kill_group(self, ident: ProcessIdentity) -> None:
        """SIGTERM the sandbox's process group, wait for every member, then SIGKILL.

        Members outliving a dead leader are killed too: while any member exists, the
        kernel never hands the group id out as a new pid, so they are ours.
        """
        if not _alive(ident) and not _group_members(ident.pid):
            return
        if self._signal_group(ident.pid, signal.SIGTERM, self.destroy_grace_s):
            return
        if not self._signal_group(ident.pid, signal.SIGKILL, 10.0):
            raise TransientProviderError(
                f"local: process group {ident.pid} survived SIGKILL for 10 s"
            )

    def _kill_marked(self, name: str) -> None:
        """SIGKILL every process still carrying this workspace's marker, and wait for them."""
        deadline = time.monotonic() + 10.0
        while pids := _marked_processes(self.root).get(name, []):
            if time.monotonic() > deadline:
                raise TransientProviderError(
                    f"local: processes {pids} of {name} survived SIGKILL for 10 s")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    @staticmethod
    def _signal_group(pgid: int, sig: int, timeout_s: float) -> bool:
        """Signal the group and wait (on pidfds) until no member is left; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        while members := _group_members(pgid):
            poller = select.poll()
            fds = []
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    fd = os.pidfd_open(pid)
                    fds.append(fd)
                    poller.register(fd, select.POLLIN)
            try:
                while fds and (left := deadline - time.monotonic()) > 0:
                    for fd, _event in poller.poll(left * 1000):
                        poller.unregister(fd)
                        fds.remove(fd)
                        os.close(fd)
            finally:
                for fd in fds:
                    os.close(fd)
            if time.monotonic() >= deadline:
                return not _group_members(pgid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)  # members forked while we waited get the signal too
        return True

    def list_managed(self) -> list[ManagedResource]:
        """Every workspace under the root (even one whose record is unreadable) and every
        marked process whose workspace is gone."""
        if not self.root.is_dir():
            return []
        found: list[ManagedResource] = []
        marked = _marked_processes(self.root)
        for path in sorted(self.root.iterdir()):
            if not path.is_dir() or not path.name.startswith("lk-"):
                continue
            record = self._read_record(path) or {}
            if record.get("installation", self.installation_id) != self.installation_id:
                continue
            created = record.get("created_at")
            ident = self._identity(record)
            raw_labels = record.get("labels")
            labels: dict[str, Any] = raw_labels if isinstance(raw_labels, dict) else {}
            alive = bool(ident and _alive(ident)) or path.name in marked
            # read after ``alive``: a command that ended by itself has its code written
            # before its wrapper exits
            code = self.exit_code(LeaseHandle(path.name, self.backend))
            found.append(ManagedResource(
                name=path.name,
                backend=self.backend,
                lease_id=record.get("lease_id") or path.name.removeprefix("lk-"),
                created_at=(datetime.fromisoformat(created) if created else
                            datetime.fromtimestamp(path.stat().st_mtime, UTC)),
                meta={"pid": ident.pid if ident else None,
                      "start_ticks": ident.start_ticks if ident else None,
                      "workspace": str(path),
                      "alive": alive,
                      "tenant": labels.get("leasekeeper.dev/tenant")},
                exit_code=code,
                exit_reason=_killed(ident, alive, code),
            ))
        listed = {r.name for r in found}
        for name, pids in sorted(marked.items()):
            if name not in listed and name.startswith("lk-"):
                found.append(ManagedResource(
                    name=name, backend=self.backend, lease_id=name.removeprefix("lk-"),
                    created_at=min((t for t in map(_started_at, pids) if t), default=None),
                    meta={"pid": None, "stray_pids": pids, "alive": True,
                          "workspace": str(self.root / name)}))
        return found
