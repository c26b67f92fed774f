"""`leasekeeper console`: serve the console (uvicorn) on LEASEKEEPER_CONSOLE_HOST (127.0.0.1
by default) and LEASEKEEPER_CONSOLE_PORT; refuses to start without
LEASEKEEPER_FLOWER_BASIC_AUTH."""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn

from providers.errors import ConfigError
from workers.console.app import build_app
from workers.console.auth import parse_basic_auth
from workers.preflight import cannot_listen, host_port, store_fit_to_start
from workers.runtime import open_store
from workers.settings import Settings


def serve(settings: Settings, on_ready: Callable[[str], None] = print) -> None:
    if settings.flower_basic_auth is None:
        raise ConfigError("LEASEKEEPER_FLOWER_BASIC_AUTH is not set: the console never runs "
                          "without basic auth; set it to user:password (the same as Flower's)")
    user, password = parse_basic_auth(settings.flower_basic_auth.get_secret_value())
    # Its pages need the schema, and retry and forget write (ConfigError, exit 2).
    store_fit_to_start("console", settings.effective_store_url, writes=True)
    store = open_store(settings, reader=True)
    app = build_app(settings, store, user, password)
    try:
        # bound here, so a port in use is one line naming the setting (uvicorn would log
        # it and exit 3, the code for an unreachable service)
        sock = _listen(settings.console_host, settings.console_port)
    except OSError as exc:
        store.dispose()
        raise cannot_listen("the console", "LEASEKEEPER_CONSOLE", settings.console_host,
                            settings.console_port, exc) from None
    # the port bound, not the setting: with LEASEKEEPER_CONSOLE_PORT=0 the system picks it
    host, port = sock.getsockname()[:2]
    on_ready(f"console: http://{host_port(host, port)}/ "
             f"(basic auth user {user!r}, password from LEASEKEEPER_FLOWER_BASIC_AUTH)")
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        server.run(sockets=[sock])
    finally:
        sock.close()
        store.dispose()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, reuse_port=False)
