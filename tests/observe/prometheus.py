"""A real Prometheus server (Debian's ``prometheus``) for tests: scrapes given targets every
two seconds (or as asked), evaluates deploy/prometheus/alerts.yml, and answers PromQL
through its HTTP API. Started on a free loopback port with its own data dir; stopped by
pid."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.services import free_port, stop_process, wait_for_port

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"


def binary(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed: run `make test` (scripts/system-deps.sh "
                           "installs Debian's prometheus package) or `apt-get install prometheus`")
    return found


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql``: [{"metric": {...}, "value": [ts, "v"]}, ...]."""
        qs = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, promql: str) -> float | None:
        """The single value of ``promql`` (summed if several series), None if empty."""
        result = self.query(promql)
        return sum(float(r["value"][1]) for r in result) if result else None

    def wait_true(self, condition: str, timeout_s: float = 60.0) -> None:
        """Until the PromQL comparison ``condition`` (e.g. ``x >= 1``) returns a series."""
        deadline = time.monotonic() + timeout_s
        while not self.query(condition):
            if time.monotonic() > deadline:
                raise AssertionError(f"{condition} never held within {timeout_s}s")
            time.sleep(0.25)

    def wait_value(self, promql: str, expected: float, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        seen: float | None = None
        while time.monotonic() < deadline:
            seen = self.value(promql)
            if seen == expected:
                return
            time.sleep(0.25)
        raise AssertionError(f"{promql} was {seen}, never {expected} within {timeout_s}s "
                             f"(Prometheus log: {self.log})")


def _wait_ready(prom: Prometheus, timeout_s: float = 60.0) -> None:
    """Until /-/ready answers 200 (the port opens while the TSDB is still loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5):
                return
        except urllib.error.URLError:
            if time.monotonic() > deadline or prom.proc.poll() is not None:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: list[str], scrape_s: int = 2
                       ) -> Iterator[Prometheus]:
    """Scraping ``targets`` every ``scrape_s`` seconds, each scrape given as long."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{scrape_s}s", "evaluation_interval": "1s",
                   "scrape_timeout": f"{scrape_s}s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "leasekeeper",
                            "static_configs": [{"targets": targets}]}],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 60, proc)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        _wait_ready(prom)
        yield prom
    finally:
        stop_process(proc)
