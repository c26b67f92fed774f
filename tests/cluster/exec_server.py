"""Owns the kubelet simulator's TLS server: the kubelet side of ``pods/exec`` (WebSocket,
``v4.channel.k8s.io`` / ``v5.channel.k8s.io``) and ``pods/log`` (``/containerLogs``), which the
real kube-apiserver proxies to the Node's ``daemonEndpoints.kubeletEndpoint.Port``.

Hand-written on the standard library (no WebSocket package needed). Every exec process runs in
its own process group; ``stop()`` kills all of them. An exec into a pod with its own
namespaces runs through the target's ``enter`` (``nsenter``), and its command is looked up in
that pod's view of the filesystem (``root``), so a missing one gets the same 126 answer either
way.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import socketserver
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, unquote, urlsplit

from tests.cluster.certs import CertPair

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
STDIN, STDOUT, STDERR, STATUS, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
SUPPORTED_PROTOCOLS = ("v4.channel.k8s.io", "v5.channel.k8s.io")


def _as_is(command: list[str]) -> list[str]:
    return command


@dataclass(frozen=True)
class ContainerTarget:
    """Where an exec or log request for one container goes: ``enter`` wraps an exec's
    command to run in the container's namespaces; ``root`` is its view of ``/``."""

    env: dict[str, str]
    cwd: Path
    log_path: Path
    running: Callable[[], bool]
    root: Path = Path("/")
    enter: Callable[[list[str]], list[str]] = _as_is

    def cannot_run(self, program: str) -> str | None:
        """Why ``program`` cannot be executed in the container's view (as ``execve`` would
        say), or None when it resolves to an executable file."""
        if "/" in program:
            candidates = [program]
        else:
            candidates = [f"{d or '.'}/{program}" for d in self.env.get("PATH", "").split(":")]
        problem = "No such file or directory"
        for candidate in candidates:
            path = self.root / candidate.lstrip("/") if candidate.startswith("/") else \
                self.cwd / candidate
            if path.is_file():
                if os.access(path, os.X_OK):
                    return None
                problem = "Permission denied"
        return problem


Resolver = Callable[[str, str, str], "ContainerTarget | None"]


def status_success() -> bytes:
    return json.dumps({"metadata": {}, "status": "Success"}).encode()


def status_exit_code(code: int, message: str | None = None) -> bytes:
    return json.dumps({
        "metadata": {}, "status": "Failure",
        "message": message or f"command terminated with non-zero exit code: exit status {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }).encode()


def status_failure(message: str) -> bytes:
    return json.dumps({"metadata": {}, "status": "Failure", "message": message,
                       "reason": "InternalError", "code": 500}).encode()


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: KubeletServer


class KubeletServer:
    """TLS server on 127.0.0.1 for exec and container logs; ``resolver(ns, pod, container)``."""

    def __init__(self, resolver: Resolver, cert: CertPair, port: int = 0) -> None:
        self.resolver = resolver
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(cert.cert), str(cert.key))
        self._server = _Server(("127.0.0.1", port), _Handler, bind_and_activate=True)
        self._server.owner = self
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen[bytes]] = set()
        self.exec_count = 0

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="kubelet-server",
                                        kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            children = list(self._children)
        for child in children:
            _kill_group(child)
        if self._thread is not None:
            self._thread.join(5)

    def wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        # A kubelet (Go) writes with TCP_NODELAY, as Go does on every TCP connection; without
        # it, Nagle's algorithm holds a frame that follows another (an exec's status after its
        # output, the close after the status) until the API server's delayed ACK, ~40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._context.wrap_socket(sock, server_side=True)

    def track(self, child: subprocess.Popen[bytes], add: bool) -> None:
        with self._lock:
            if add:
                self._children.add(child)
                self.exec_count += 1
            else:
                self._children.discard(child)


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["0"])[0] in ("1", "true")


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(5)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            self.sock = self.server.owner.wrap(self.request)
        except (ssl.SSLError, OSError):
            return
        self.sock.settimeout(None)
        try:
            head = self._read_head()
            if head is None:
                return
            method, target, headers = head
            url = urlsplit(target)
            query = parse_qs(url.query)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts[0] in ("exec", "attach") and len(parts) in (4, 5) and method == "GET":
                self._exec(parts[1], parts[2], parts[-1], query, headers, parts[0] == "exec")
            elif parts[0] == "containerLogs" and len(parts) == 4:
                self._logs(parts[1], parts[2], parts[3], query)
            elif parts[0] in ("healthz", "readyz"):
                self._respond(200, b"ok")
            else:
                self._respond(404, b"404 page not found")
        except (OSError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()

    # -- HTTP -----------------------------------------------------------------------------
    def _read_head(self) -> tuple[str, str, dict[str, str]] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            data += chunk
            if len(data) > 65536:
                return None
        head, _, self.leftover = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return method, target, headers

    def _respond(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(code, "Error")
        self.sock.sendall(
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)

    def _logs(self, namespace: str, pod: str, container: str, query: dict[str, list[str]]) -> None:
        target = self.server.owner.resolver(namespace, pod, container)
        if target is None:
            self._respond(404, f'container "{container}" in pod "{pod}" not found'.encode())
            return
        follow = query.get("follow", ["false"])[0] == "true"
        tail = query.get("tailLines", [None])[0]
        data = target.log_path.read_bytes() if target.log_path.exists() else b""
        if tail is not None:
            kept = data.splitlines(keepends=True)[-int(tail):] if int(tail) > 0 else []
            data = b"".join(kept)
        if not follow:
            self._respond(200, data)
            return
        self.sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                          b"Connection: close\r\n\r\n" + data)
        offset = target.log_path.stat().st_size if target.log_path.exists() else 0
        while True:
            alive = target.running()
            size = target.log_path.stat().st_size if target.log_path.exists() else 0
            if size > offset:
                with open(target.log_path, "rb") as log:
                    log.seek(offset)
                    self.sock.sendall(log.read(size - offset))
                offset = size
            elif not alive:
                return
            time.sleep(0.1)

    # -- WebSocket exec -------------------------------------------------------------------
    def _exec(self, namespace: str, pod: str, container: str, query: dict[str, list[str]],
              headers: dict[str, str], is_exec: bool) -> None:
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        protocol = next((p for p in SUPPORTED_PROTOCOLS if p in offered), None)
        key = headers.get("sec-websocket-key")
        if headers.get("upgrade", "").lower() != "websocket" or not key:
            self._respond(400, b"only WebSocket exec is supported by the kubelet simulator")
            return
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        reply = ("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n")
        if protocol:
            reply += f"Sec-WebSocket-Protocol: {protocol}\r\n"
        self.sock.sendall((reply + "\r\n").encode())
        self.protocol = protocol or "v4.channel.k8s.io"
        self.send_lock = threading.Lock()
        target = self.server.owner.resolver(namespace, pod, container)
        command = query.get("command", [])
        if target is None or not target.running():
            self._finish(status_failure(f'container "{container}" in pod "{pod}" is not running'))
            return
        if not is_exec or not command:
            self._finish(status_failure("attach and empty commands are not supported"))
            return
        # the API server passes input/output/error/tty (kubectl's stdin is "input" here)
        want_stdin = _flag(query, "input") or _flag(query, "stdin")
        tty = _flag(query, "tty")
        problem = target.cannot_run(command[0])
        if problem is not None:
            self._finish(status_exit_code(126, f"exec: {command[0]!r}: {problem}"))
            return
        try:
            child = subprocess.Popen(
                target.enter(command), env=target.env, cwd=target.cwd, start_new_session=True,
                stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if tty else subprocess.PIPE)
        except OSError as exc:
            self._finish(status_exit_code(126, f"exec: {command[0]!r}: {exc.strerror}"))
            return
        self.server.owner.track(child, True)
        try:
            self._pump(child, want_stdin)
        finally:
            _kill_group(child)
            self.server.owner.track(child, False)

    def _pump(self, child: subprocess.Popen[bytes], want_stdin: bool) -> None:
        readers = []
        for channel, pipe in ((STDOUT, child.stdout), (STDERR, child.stderr)):
            if pipe is not None:
                thread = threading.Thread(target=self._copy_out, args=(channel, pipe), daemon=True)
                thread.start()
                readers.append(thread)
        stdin_thread = None
        if want_stdin:
            stdin_thread = threading.Thread(target=self._copy_in, args=(child,), daemon=True)
            stdin_thread.start()
        for thread in readers:
            thread.join()
        code = child.wait()
        if code < 0:
            code = 128 - code
        self._finish(status_success() if code == 0 else status_exit_code(code), stdin_thread)

    def _copy_out(self, channel: int, pipe: IO[bytes]) -> None:
        read = pipe.read1  # type: ignore[attr-defined]
        while True:
            data = read(65536)
            if not data:
                return
            self._send_frame(bytes([channel]) + data)

    def _copy_in(self, child: subprocess.Popen[bytes]) -> None:
        stdin = child.stdin
        assert stdin is not None
        try:
            while True:
                frame = self._recv_frame()
                if frame is None:
                    break
                opcode, payload = frame
                if opcode == 0x8:
                    break
                if opcode == 0x9:
                    self._send_frame(payload, opcode=0xA)
                    continue
                if not payload:
                    continue
                if payload[0] == STDIN:
                    stdin.write(payload[1:])
                    stdin.flush()
                elif payload[0] == CLOSE and payload[1:2] == bytes([STDIN]):
                    break
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _finish(self, status: bytes, stdin_thread: threading.Thread | None = None) -> None:
        """Send the status and a close frame, then wait (briefly) for the client's close."""
        self._send_frame(bytes([STATUS]) + status)
        self._send_frame(struct.pack("!H", 1000), opcode=0x8)
        if stdin_thread is not None:
            stdin_thread.join(2.0)  # it returns on the client's close frame
            return
        self.sock.settimeout(2.0)
        try:
            while True:
                frame = self._recv_frame()
                if frame is None or frame[0] == 0x8:
                    return
        except (OSError, ValueError):
            return

    def _send_frame(self, payload: bytes, opcode: int = 0x2) -> None:
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x80 | opcode, length)
        elif length < 65536:
            header = struct.pack("!BBH", 0x80 | opcode, 126, length)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 127, length)
        with self.send_lock:
            self.sock.sendall(header + payload)

    def _recv_exact(self, count: int) -> bytes | None:
        data = self.leftover
        while len(data) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        self.leftover = data[count:]
        return data[:count]

    def _recv_frame(self) -> tuple[int, bytes] | None:
        head = self._recv_exact(2)
        if head is None:
            return None
        opcode, length = head[0] & 0x0F, head[1] & 0x7F
        masked = head[1] & 0x80
        if length == 126:
            ext = self._recv_exact(2)
            length = struct.unpack("!H", ext)[0] if ext else 0
        elif length == 127:
            ext = self._recv_exact(8)
            length = struct.unpack("!Q", ext)[0] if ext else 0
        mask = self._recv_exact(4) if masked else b"\0\0\0\0"
        payload = self._recv_exact(length) if length else b""
        if mask is None or payload is None:
            return None
        if masked:
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return opcode, payload
