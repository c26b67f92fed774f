"""`leasekeeper metrics` as a real subprocess with the settings a test gives it (no worker
stack of its own), scraped over HTTP and parsed. Started on a free loopback port, stopped
by pid."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import cli_env
from tests.services import free_port, stop_process, wait_for_port

REPO = Path(__file__).resolve().parents[2]
# Only so that a scrape that never answers fails the test instead of hanging it: far above
# what any scrape may take (the tests assert what a scrape answers, not how fast).
SCRAPE_WAIT_S = 120.0

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Samples:
    """One scrape's samples, by name and labels."""

    found: dict[tuple[str, Labels], float]

    def value(self, name: str, **labels: str) -> float | None:
        return self.found.get((name, tuple(sorted(labels.items()))))

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` that have these labels (and any others)."""
        return sum(v for (sample, key), v in self.found.items()
                   if sample == name and labels.items() <= dict(key).items())

    def labels(self, name: str, label: str) -> set[str]:
        """The values of ``label`` among the samples of ``name``."""
        return {dict(key)[label] for sample, key in self.found if sample == name}


@dataclass
class Exporter:
    address: str
    log: Path

    def scrape(self) -> Samples:
        with urllib.request.urlopen(f"http://{self.address}/metrics",
                                    timeout=SCRAPE_WAIT_S) as resp:
            text = resp.read().decode()
        return Samples({(s.name, tuple(sorted(s.labels.items()))): s.value
                        for family in text_string_to_metric_families(text)
                        for s in family.samples})


@contextlib.contextmanager
def running_exporter(log: Path, **settings: str) -> Iterator[Exporter]:
    """``leasekeeper metrics`` with these LEASEKEEPER_* settings (and no others)."""
    port = free_port()
    env = cli_env(LEASEKEEPER_METRICS_PORT=str(port), **settings)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "metrics"], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 60, proc)
        yield Exporter(f"127.0.0.1:{port}", log)
    finally:
        stop_process(proc)
