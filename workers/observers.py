"""The exporter and the console as children of `leasekeeper up` (workers/embedded.py): each
on its setting's port when one is set (taken: fail at once, naming it), else on a free
loopback port; the console gets the same basic auth as Flower, by environment (never on a
command line). Each counts as ready once it answers HTTP on its port."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from providers.errors import ConfigError
from workers.settings import Settings

if TYPE_CHECKING:
    from workers.embedded import Supervisor


@dataclass(frozen=True)
class Observers:
    metrics_url: str
    console_url: str
    probes: dict[str, Callable[[], bool]]


def start_observers(sup: Supervisor, settings: Settings, env: dict[str, str], auth: str,
                    flower_url: str) -> Observers:
    metrics_port = _port(settings, "metrics_port", "LEASEKEEPER_METRICS_PORT")
    console_port = _port(settings, "console_port", "LEASEKEEPER_CONSOLE_PORT")
    cli = [sys.executable, "-m", "workers.cli"]
    sup.start("metrics", [*cli, "metrics"],
              {**env, "LEASEKEEPER_METRICS_PORT": str(metrics_port)})
    sup.start("console", [*cli, "console"],
              {**env, "LEASEKEEPER_CONSOLE_PORT": str(console_port),
               "LEASEKEEPER_FLOWER_BASIC_AUTH": auth,
               "LEASEKEEPER_CONSOLE_FLOWER_URL": flower_url})
    metrics_url = f"http://{settings.metrics_host}:{metrics_port}/metrics"
    console_url = f"http://{settings.console_host}:{console_port}/"
    return Observers(metrics_url, console_url,
                     {"metrics": lambda: _answers(metrics_url),
                      "console": lambda: _answers(console_url)})


def _port(settings: Settings, field: str, variable: str) -> int:
    from workers.embedded import free_port, port_is_free

    port = int(getattr(settings, field))
    if field not in settings.model_fields_set or port == 0:
        return free_port()
    if not port_is_free(port):
        host = getattr(settings, field.replace("_port", "_host"))
        raise ConfigError(f"{variable}={port}: {host}:{port} is taken by another process "
                          f"(another `leasekeeper up`?); free it, or set {variable}=0 for "
                          "any free port")
    return port


def _answers(url: str) -> bool:
    """Any HTTP answer (the console answers 401 without credentials) means it serves."""
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 (http on loopback)
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
