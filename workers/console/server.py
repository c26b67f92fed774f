"""`leasekeeper console`: serve the console (uvicorn) on LEASEKEEPER_CONSOLE_HOST (127.0.0.1
by default) and LEASEKEEPER_CONSOLE_PORT; refuses to start without
LEASEKEEPER_FLOWER_BASIC_AUTH."""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from models.store import Store
from providers.errors import ConfigError
from workers.console.app import build_app
from workers.console.auth import parse_basic_auth
from workers.settings import Settings


def serve(settings: Settings, on_ready: Callable[[str], None] = print) -> None:
    if settings.flower_basic_auth is None:
        raise ConfigError("LEASEKEEPER_FLOWER_BASIC_AUTH is not set: the console never runs "
                          "without basic auth; set it to user:password (the same as Flower's)")
    user, password = parse_basic_auth(settings.flower_basic_auth.get_secret_value())
    store = Store(settings.effective_store_url, settings.store_statement_timeout_s)
    app = build_app(settings, store, user, password)
    on_ready(f"console: http://{settings.console_host}:{settings.console_port}/ "
             f"(basic auth user {user!r}, password from LEASEKEEPER_FLOWER_BASIC_AUTH)")
    try:
        uvicorn.run(app, host=settings.console_host, port=settings.console_port,
                    log_level="warning", access_log=False)
    finally:
        store.dispose()
