"""What a worker process works with: settings, the store and the enabled providers.

Built lazily on first use in each process (never at import) and rebuilt after a fork, so
prefork children do not share database connections. Every provider it builds records the
ProviderErrors its calls raise (workers/provider_errors.py). Tests inject their own with
``set_runtime``.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from models.store import Store
from providers.base import Provider
from providers.errors import ConfigError, InvalidRequest
from providers.faulty import FaultPlan, FaultyProvider
from providers.local import LocalProvider
from providers.noop import NoopProvider
from workers.settings import PROVIDER_NAMES, Settings, get_settings, provider_not_enabled


def _local(settings: Settings) -> Provider:
    return LocalProvider(settings.effective_local_root, settings.installation_id,
                         settings.local_destroy_grace_s)


def _faulty(settings: Settings) -> Provider:
    if settings.faults_file is None:
        raise ConfigError("the faulty provider needs LEASEKEEPER_FAULTS_FILE (tests only)")
    inner = LocalProvider(settings.effective_local_root / "faulty", settings.installation_id,
                          settings.local_destroy_grace_s)
    return FaultyProvider(inner, FaultPlan(settings.faults_file))


def _kubernetes(settings: Settings) -> Provider:
    from providers.kubernetes.provider import build_kubernetes_provider

    provider: Provider = build_kubernetes_provider(settings)
    return provider


# Modules of providers too heavy to import in each prefork child: the kubernetes client's
# models cost ~3.5 s of CPU to import (tens of seconds of wall time on a loaded host), paid
# on a child's first task and again by every child that replaces a dead one. The worker's
# main process imports them before the pool forks (workers/app.py); children inherit them.
PROVIDER_MODULES: dict[str, str] = {"kubernetes": "providers.kubernetes.provider"}

PROVIDER_FACTORIES: dict[str, Callable[[Settings], Provider]] = {
    "local": _local,
    "noop": lambda _settings: NoopProvider(),
    "faulty": _faulty,
    "kubernetes": _kubernetes,
}
# The settings refuse any other name (LEASEKEEPER_PROVIDERS is checked at start-up).
if set(PROVIDER_FACTORIES) != set(PROVIDER_NAMES):
    raise RuntimeError("workers.settings.PROVIDER_NAMES and PROVIDER_FACTORIES disagree")


@dataclass
class Runtime:
    settings: Settings
    store: Store
    _providers: dict[str, Provider] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _redis: redis.Redis[bytes] | None = None

    def provider(self, name: str) -> Provider:
        if name not in self.settings.providers:
            raise InvalidRequest(provider_not_enabled(
                name, self.settings.providers, "this worker",
                "add it to LEASEKEEPER_PROVIDERS to use it"))
        with self._lock:
            if name not in self._providers:
                factory = PROVIDER_FACTORIES[name]  # the settings allow no other name
                from workers.provider_errors import RecordingProvider

                self._providers[name] = RecordingProvider(
                    factory(self.settings), self.store, self.settings.provider_errors_kept)
            return self._providers[name]

    def redis(self) -> redis.Redis[bytes]:
        """The broker's Redis, for sweep locks (created on first use)."""
        with self._lock:
            if self._redis is None:
                self._redis = redis.Redis.from_url(
                    self.settings.effective_broker_url, socket_timeout=5,
                    socket_connect_timeout=5)
            return self._redis

    def put_provider(self, provider: Provider) -> None:
        """Use this provider instance for its name (tests, benchmarks)."""
        self._providers[provider.name] = provider


def import_provider_modules(settings: Settings) -> list[str]:
    """Import (never build: no client or connection may cross a fork) the modules of the
    enabled providers listed in PROVIDER_MODULES; returns their names."""
    names = [PROVIDER_MODULES[p] for p in settings.providers if p in PROVIDER_MODULES]
    for name in names:
        importlib.import_module(name)
    return names


_runtime: Runtime | None = None
_runtime_pid: int | None = None


def open_store(settings: Settings, reader: bool = False) -> Store:
    """The store as the settings describe it (worker, exporter, console, CLI). ``reader``:
    a long-running process that retries nothing (the exporter, the console): a pooled
    connection is checked before use, so the first request after a database restart is
    answered rather than failed."""
    return Store(settings.effective_store_url, settings.store_statement_timeout_s,
                 prepared_statements=settings.store_prepared_statements, pre_ping=reader)


def get_runtime() -> Runtime:
    global _runtime, _runtime_pid
    if _runtime is None or _runtime_pid != os.getpid():
        settings = get_settings()
        _runtime = Runtime(settings=settings, store=open_store(settings))
        _runtime_pid = os.getpid()
    return _runtime


def set_runtime(runtime: Runtime | None) -> None:
    global _runtime, _runtime_pid
    _runtime, _runtime_pid = runtime, os.getpid() if runtime else None
