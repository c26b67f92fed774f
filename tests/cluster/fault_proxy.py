"""Owns the fault-injecting HTTPS reverse proxy that tests put between a client and the API
server: it forwards everything (bodies, watch and log streams chunk by chunk, WebSocket exec
upgrades), counts requests by (method, path), and answers requests that match programmed rules
with a Kubernetes ``Status`` error (500, 429 with Retry-After, 403, any code), a dropped
connection, a delay, or a hold (in flight until the test releases it). TLS is terminated
with a loopback certificate of the harness CA."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import select
import socket
import socketserver
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

from tests.cluster.certs import CertPair, make_ca, make_server_cert
from tests.cluster.kubeconfig import write_kubeconfig

Action = Literal["status", "drop", "delay", "hold", "hold-status"]
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
           409: "Conflict", 410: "Expired", 422: "Invalid", 429: "TooManyRequests",
           500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


def status_body(code: int, message: str, reason: str | None = None,
                retry_after: int | None = None) -> bytes:
    """A ``Status`` object as the API server writes it for an error."""
    status: dict[str, object] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                 "status": "Failure", "message": message,
                                 "reason": reason or REASONS.get(code, "InternalError"),
                                 "code": code}
    if retry_after is not None:
        status["details"] = {"retryAfterSeconds": retry_after}
    return json.dumps(status).encode()


@dataclass
class Rule:
    """Matches ``method`` (``*`` for any) and ``path`` (regex searched in the URL path, and in
    ``query`` when given); acts on the next ``times`` matches (``None``: every match)."""

    method: str
    path: str
    action: Action = "status"
    code: int = 500
    message: str | None = None
    reason: str | None = None
    retry_after: int | None = None
    delay: float = 0.0
    times: int | None = 1
    query: str | None = None
    hits: int = 0
    # "hold": a matching request waits, unanswered, until ``released`` is set; ``arrived``
    # is set when the first one does (so a test can act while the request is in flight).
    arrived: threading.Event = field(default_factory=threading.Event, repr=False)
    released: threading.Event = field(default_factory=threading.Event, repr=False)
    _path_re: re.Pattern[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._path_re = re.compile(self.path)

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method != "*" and self.method.upper() != method:
            return False
        if not self._path_re.search(path):
            return False
        return self.query is None or re.search(self.query, query) is not None

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: str
    at: float
    rule: Rule | None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: FaultProxy

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket],
                     client_address: tuple[str, int]) -> None:
        """A client or upstream that hung up mid-stream (a closed watch, a cut connection)
        is routine for a proxy; anything else is printed as usual."""
        if isinstance(sys.exc_info()[1], OSError | ValueError):
            return
        super().handle_error(request, client_address)

    def finish_request(self, request: socket.socket | tuple[bytes, socket.socket],
                       client_address: tuple[str, int]) -> None:
        assert isinstance(request, socket.socket)
        try:
            wrapped = self.owner.server_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        self.owner.track(wrapped, True)
        try:
            socketserver.TCPServer.finish_request(self, wrapped, client_address)
        finally:
            self.owner.track(wrapped, False)


class FaultProxy:
    """HTTPS reverse proxy on 127.0.0.1 in front of ``upstream`` (context manager)."""

    def __init__(self, upstream: str, *, upstream_ca: Path | None, token: str | None = None,
                 ca: CertPair | None = None, workdir: Path | None = None) -> None:
        self.upstream = urlsplit(upstream)
        self.token = token
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="lk-proxy-"))
        self.ca = ca or make_ca(self.workdir / "pki")
        cert = make_server_cert(self.ca, self.workdir / "pki", "fault-proxy")
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.load_cert_chain(str(cert.cert), str(cert.key))
        if upstream_ca is not None:
            self.upstream_context = ssl.create_default_context(cafile=str(upstream_ca))
        else:
            self.upstream_context = ssl._create_unverified_context()
        self.rules: list[Rule] = []
        self.records: list[RequestRecord] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._sockets: set[ssl.SSLSocket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread: threading.Thread | None = None
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self.kubeconfig_path = self.workdir / "proxy.kubeconfig"
        if token:
            self.kubeconfig_for_token(token, self.kubeconfig_path)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy",
                                        kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.clear_rules()  # held requests go on, so their threads end
        self._server.shutdown()
        self.close_streams()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def kubeconfig_for_token(self, token: str, path: Path | None = None) -> Path:
        """A kubeconfig that reaches the API server through this proxy with ``token``."""
        path = path or self.workdir / f"proxy-{abs(hash(token)) % 10**8}.kubeconfig"
        return write_kubeconfig(path, self.url, token, self.ca.cert, "proxy-user")

    # -- rules ----------------------------------------------------------------------------
    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail(self, method: str, path: str, code: int = 500, times: int | None = 1,
             message: str | None = None, reason: str | None = None,
             retry_after: int | None = None, query: str | None = None) -> Rule:
        """Answer the next ``times`` matching requests with ``code`` and a Status body."""
        return self.add_rule(Rule(method, path, "status", code, message, reason, retry_after,
                                  times=times, query=query))

    def throttle(self, method: str, path: str, retry_after: int = 1,
                 times: int | None = 1) -> Rule:
        """429 TooManyRequests with a Retry-After header."""
        return self.fail(method, path, 429, times, "Too many requests, please try again later.",
                         retry_after=retry_after)

    def forbid(self, method: str, path: str, times: int | None = 1,
               message: str = "forbidden by the fault proxy") -> Rule:
        return self.fail(method, path, 403, times, message)

    def drop(self, method: str, path: str, times: int | None = 1) -> Rule:
        """Close the connection without answering."""
        return self.add_rule(Rule(method, path, "drop", times=times))

    def delay(self, method: str, path: str, seconds: float, times: int | None = 1) -> Rule:
        """Hold the request ``seconds`` before forwarding it."""
        return self.add_rule(Rule(method, path, "delay", delay=seconds, times=times))

    def hold(self, method: str, path: str, times: int | None = 1) -> Rule:
        """Keep matching requests in flight until ``rule.released.set()`` (or clear_rules),
        then forward them; ``rule.arrived`` is set once one is held."""
        return self.add_rule(Rule(method, path, "hold", times=times))

    def hold_then_fail(self, method: str, path: str, code: int, times: int | None = 1,
                       message: str | None = None, reason: str | None = None,
                       query: str | None = None) -> Rule:
        """Keep matching requests in flight until ``rule.released.set()``, then answer them
        with ``code`` (never forwarded): a test changes the cluster while a request waits,
        then the answer is one the server gives after that change (410 Expired)."""
        return self.add_rule(Rule(method, path, "hold-status", code, message, reason,
                                  times=times, query=query))

    def clear_rules(self) -> None:
        with self._lock:
            for rule in self.rules:
                rule.released.set()
            self.rules.clear()

    def match(self, method: str, path: str, query: str) -> Rule | None:
        with self._lock:
            rule = next((r for r in self.rules if r.matches(method, path, query)), None)
            if rule is not None:
                rule.hits += 1
            self.records.append(RequestRecord(method, path, query, time.monotonic(), rule))
            self.counts[(method, path)] += 1
            return rule

    # -- counting -------------------------------------------------------------------------
    def count(self, method: str | None = None, path: str | None = None,
              query: str | None = None) -> int:
        """Requests seen with ``method`` (any if None) whose path matches regex ``path``."""
        with self._lock:
            return sum(1 for r in self.records
                       if (method is None or r.method == method.upper())
                       and (path is None or re.search(path, r.path))
                       and (query is None or re.search(query, r.query)))

    def reset_counts(self) -> None:
        with self._lock:
            self.records.clear()
            self.counts.clear()

    # -- connections ----------------------------------------------------------------------
    def track(self, sock: ssl.SSLSocket, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)

    def close_streams(self) -> None:
        """Cut every open client connection (watches, log follows, exec sessions)."""
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def open_upstream(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.upstream.hostname or "127.0.0.1",
                                           self.upstream.port or 443,
                                           context=self.upstream_context, timeout=None)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        self._proxy()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def _proxy(self) -> None:
        owner = self.server.owner
        split = urlsplit(self.path)
        rule = owner.match(self.command, split.path, split.query)
        body = self._read_body()
        if rule is not None:
            if rule.action == "drop":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(self.connection, socket.SHUT_RDWR)
                return
            if rule.action == "status":
                self._send_status(rule)
                return
            if rule.action in ("hold", "hold-status"):
                rule.arrived.set()
                rule.released.wait()
            if rule.action == "hold-status":
                self._send_status(rule)
                return
            time.sleep(rule.delay)
        if self.headers.get("Upgrade"):
            self._tunnel(body)
            return
        self._forward(body)

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            data = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _send_status(self, rule: Rule) -> None:
        message = rule.message or f"injected by the fault proxy ({rule.code})"
        body = status_body(rule.code, message, rule.reason, rule.retry_after)
        self.send_response(rule.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if rule.retry_after is not None:
            self.send_header("Retry-After", str(rule.retry_after))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes) -> None:
        owner = self.server.owner
        upstream = owner.open_upstream()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
        except OSError as exc:
            payload = status_body(502, f"fault proxy: upstream unreachable: {exc}")
            self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        try:
            self._relay(response)
        finally:
            upstream.close()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        self.send_response(response.status, response.reason)
        length = response.getheader("Content-Length")
        for key, value in response.getheaders():
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        if length is not None:
            self.send_header("Content-Length", length)
        elif self.command != "HEAD":
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.command == "HEAD":
            return
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            if length is not None:
                self.wfile.write(chunk)
            else:
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        if length is None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _tunnel(self, body: bytes) -> None:
        """Pass an Upgrade (WebSocket exec) request and its bytes through unchanged."""
        owner = self.server.owner
        self.close_connection = True
        raw = socket.create_connection((owner.upstream.hostname or "127.0.0.1",
                                        owner.upstream.port or 443))
        upstream = owner.upstream_context.wrap_socket(
            raw, server_hostname=owner.upstream.hostname)
        head = f"{self.command} {self.path} HTTP/1.1\r\n"
        for key, value in self.headers.items():
            if key.lower() != "host":
                head += f"{key}: {value}\r\n"
        head += f"Host: {owner.upstream.netloc}\r\n\r\n"
        upstream.sendall(head.encode() + body)
        self.wfile.flush()
        try:
            # The client sends no frame before the 101 answer, so rfile holds nothing more.
            _pipe(self.connection, upstream)
        finally:
            upstream.close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes (TLS-aware: drains pending records)."""
    peers = {a: b, b: a}
    while True:
        ready: list[socket.socket] = [
            s for s in (a, b) if isinstance(s, ssl.SSLSocket) and s.pending()]
        if not ready:
            ready, _, _ = select.select([a, b], [], [], 1.0)
        for sock in ready:
            try:
                data = sock.recv(65536)
            except (OSError, ssl.SSLError):
                return
            if not data:
                return
            try:
                peers[sock].sendall(data)
            except OSError:
                return
