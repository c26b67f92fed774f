"""The exporter and the console as children of `leasekeeper up` (workers/embedded.py): each
on its setting's port when one is set, else on a free loopback port; the console gets the
same basic auth as Flower, by environment (never on a command line)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.settings import Settings

if TYPE_CHECKING:
    from workers.embedded import Supervisor


@dataclass(frozen=True)
class Observers:
    metrics_url: str
    console_url: str


def start_observers(sup: Supervisor, settings: Settings, env: dict[str, str], auth: str,
                    flower_url: str) -> Observers:
    from workers.embedded import free_port, wait_for_port

    chosen = settings.model_fields_set
    metrics_port = settings.metrics_port if "metrics_port" in chosen else free_port()
    console_port = settings.console_port if "console_port" in chosen else free_port()
    cli = [sys.executable, "-m", "workers.cli"]
    metrics = sup.start("metrics", [*cli, "metrics"],
                        {**env, "LEASEKEEPER_METRICS_PORT": str(metrics_port)})
    console = sup.start("console", [*cli, "console"],
                        {**env, "LEASEKEEPER_CONSOLE_PORT": str(console_port),
                         "LEASEKEEPER_FLOWER_BASIC_AUTH": auth,
                         "LEASEKEEPER_CONSOLE_FLOWER_URL": flower_url})
    wait_for_port(metrics_port, 60, metrics)
    wait_for_port(console_port, 60, console)
    return Observers(f"http://{settings.metrics_host}:{metrics_port}/metrics",
                     f"http://{settings.console_host}:{console_port}/")
