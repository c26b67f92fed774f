"""deploy/prometheus/alerts.yml against what the real exporter serves: `leasekeeper metrics`
runs on a real Redis and SQLite store, is scraped over HTTP, and

- every metric an alert's expression reads, every label it matches, groups or joins on,
  and every label value it matches exactly, is in the scrape (after leases moved and
  every sweep ticked);
- a scrape is replayed to promtool as series held for 40 minutes, so each alert is
  evaluated on the exporter's real names, labels and values: with the store unreadable,
  MetricsStoreUnreadable fires and the sweep alerts stay quiet (the exporter cannot read
  the ticks: that is not "a sweep never ran").
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks import producer
from tests.e2e.conftest import eventually
from tests.observe.conftest import leasekeeper_process
from tests.observe.exporter import Exporter, Samples, running_exporter
from tests.observe.prometheus import ALERTS, binary
from tests.services import RedisServer, free_port
from tests.stack import WorkerStack
from workers.app import app
from workers.beat import SWEEPS
from workers.queues import Lane, queue_name

pytestmark = pytest.mark.timeout(300)
# Labels Prometheus adds to every scraped series (`le` is a histogram bucket's).
TARGET_LABELS = {"job", "instance"}
_SELECTOR = re.compile(r"\b(leasekeeper_[a-z_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def alert_rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def parse(text: str) -> tuple[Series, set[str]]:
    """The samples of a scrape (without prometheus-client's own python_/process_ and
    *_created series) and the names of the families it declares (HELP lines)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: Series = {}
    declared: set[str] = set()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("leasekeeper_"):
            continue
        declared.add(family.name + ("_total" if family.type == "counter" else ""))
        for s in family.samples:
            if not s.name.endswith("_created"):
                found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found, declared


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=120) as resp:
        return str(resp.read().decode())


def replay(series: Series, checks: list[dict[str, Any]], workdir: Path, minutes: int = 40
           ) -> subprocess.CompletedProcess[str]:
    """promtool's verdict on ``checks`` (alert_rule_test entries) with every scraped series
    held at its value for ``minutes``, as scraped by job "leasekeeper"."""
    inputs = []
    for (name, labels), value in sorted(series.items()):
        all_labels = {**dict(labels), "job": "leasekeeper", "instance": "127.0.0.1:9808"}
        selector = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(all_labels.items()))
        inputs.append({"series": f"{name}{{{selector}}}", "values": f"{value!r}x{minutes}"})
    test = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}]}
    path = workdir / "replay.yml"
    path.write_text(yaml.safe_dump(test))
    return subprocess.run([binary("promtool"), "test", "rules", str(path)],
                          capture_output=True, text=True, check=False)


def fired(series: Series, alertname: str, workdir: Path, at: str = "35m") -> bool:
    """Whether promtool sees ``alertname`` firing at ``at`` on the replayed series."""
    quiet = replay(series, [{"eval_time": at, "alertname": alertname, "exp_alerts": []}],
                   workdir)
    said = quiet.stdout + quiet.stderr
    assert ("SUCCESS" in said) != ("FAILED:" in said), said  # ran, and said which
    return "FAILED:" in said


def test_every_alert_reads_names_labels_and_values_the_exporter_serves(
        own_stack: WorkerStack, tmp_path: Path) -> None:
    port = free_port()
    pool = {"name": "py", "provider": "local", "size": 0, "max_size": 0}
    env = {"LEASEKEEPER_METRICS_PORT": str(port), "LEASEKEEPER_POOLS": json.dumps([pool])}
    with leasekeeper_process(own_stack, "metrics", env, port, tmp_path / "exporter.log"):
        exporter = f"127.0.0.1:{port}"
        scrape(exporter)  # the exporter counts the logs from its first scrape on
        kept, gone = (producer.acquire_lease(f"run-{uuid.uuid4().hex[:12]}", {"tenant": "t1"})
                      .get(90)["lease_id"] for _ in range(2))
        producer.destroy_lease(gone).get(60)
        for sweep in SWEEPS:
            app.send_task(sweep).get(60)
        series, declared = parse(scrape(exporter))
        producer.destroy_lease(kept).get(60)
    labels_of: dict[str, set[str]] = {}
    values_of: dict[tuple[str, str], set[str]] = {}
    for name, labels in series:
        labels_of.setdefault(name, set()).update(k for k, _ in labels)
        for k, v in labels:
            values_of.setdefault((name, k), set()).add(v)

    problems = []
    for alert, rule in alert_rules().items():
        expr = " ".join(str(rule["expr"]).split())
        names = set()
        for name, matchers in _SELECTOR.findall(expr):
            names.add(name)
            if name not in labels_of:
                problems.append(f"{alert}: {name} is not in the scrape "
                                f"(declared: {name in declared})")
                continue
            for label, op, value in _MATCHER.findall(matchers):
                if label not in labels_of[name]:
                    problems.append(f"{alert}: {name} has no label {label!r}")
                elif op == "=" and value not in values_of[(name, label)]:
                    problems.append(f"{alert}: {name}{{{label}={value!r}}} is never served "
                                    f"(served: {sorted(values_of[(name, label)])})")
        usable = TARGET_LABELS.union(*(labels_of.get(n, set()) for n in names))
        for group in _GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                if label not in usable:
                    problems.append(f"{alert}: groups or joins on {label!r}, which none of "
                                    f"{sorted(names)} has")
    assert not problems, "\n".join(problems)


def test_with_the_store_unreadable_only_the_store_alert_speaks_for_the_sweeps(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """The real exporter on a store it cannot read (a PostgreSQL server that is not there;
    the exporter starts anyway, as on a store that does not answer yet) still serves every
    sweep's interval but no tick (it could not read them): MetricsStoreUnreadable fires;
    SweepNeverRan ("no recorded tick at all") and SweepStalled must not, 40 minutes into
    the outage. (A store that answers without the schema is refused at start instead:
    tests/e2e/test_observers_store_at_start.py.)"""
    gone = f"postgresql+psycopg://leasekeeper@127.0.0.1:{free_port()}/leasekeeper"
    with running_exporter(tmp_path / "exporter.log", LEASEKEEPER_STORE_URL=gone,
                          LEASEKEEPER_BROKER_URL=redis_server.url) as exp:
        series, _ = parse(scrape(exp.address))
    assert series[("leasekeeper_store_up", ())] == 0
    assert {dict(k)["sweep"] for n, k in series
            if n == "leasekeeper_sweep_interval_seconds"} == set(SWEEPS)
    assert not any(n == "leasekeeper_sweep_last_tick_timestamp_seconds" for n, _ in series)
    assert fired(series, "MetricsStoreUnreadable", tmp_path)
    assert not fired(series, "SweepNeverRan", tmp_path)
    assert not fired(series, "SweepStalled", tmp_path)


def test_only_this_installations_workers_count_as_up(
        own_stack: WorkerStack, redis_server: RedisServer, tmp_path: Path) -> None:
    """Two installations share one Redis, each with its own LEASEKEEPER_TASK_QUEUE (as
    workers/settings.py says they must). The module's worker serves the other one: this
    installation's exporter reaches the broker but counts no worker, so NoWorker can fire
    for it; the other installation's exporter counts its worker."""
    ours = f"lonely-{uuid.uuid4().hex[:8]}"
    with running_exporter(tmp_path / "ours.log", LEASEKEEPER_TASK_QUEUE=ours,
                          LEASEKEEPER_STORE_URL=own_stack.store_url,
                          LEASEKEEPER_BROKER_URL=redis_server.url,
                          LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="2") as exp:
        seen = exp.scrape()
    assert seen.value("leasekeeper_broker_up") == 1
    assert seen.value("leasekeeper_workers_up") == 0
    series = {k: v for k, v in seen.found.items()
              if k[0].startswith("leasekeeper_") and not k[0].endswith("_created")}
    assert fired(series, "NoWorker", tmp_path, at="5m")
    with running_exporter(tmp_path / "theirs.log",
                          LEASEKEEPER_TASK_QUEUE=own_stack.env["LEASEKEEPER_TASK_QUEUE"],
                          LEASEKEEPER_STORE_URL=own_stack.store_url,
                          LEASEKEEPER_BROKER_URL=redis_server.url,
                          LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="2") as exp:
        assert eventually(lambda: (exp.scrape().value("leasekeeper_workers_up") or 0) >= 1,
                          60, "the stack's worker to be counted by its own exporter")


def answered(exp: Exporter) -> Samples | None:
    """A scrape in which a worker answered the exporter's ping."""
    seen = exp.scrape()
    return seen if seen.value("leasekeeper_workers_up") else None


def test_a_lane_no_worker_consumes_is_counted_and_alerted(
        own_stack: WorkerStack, redis_server: RedisServer, tmp_path: Path) -> None:
    """A worker answers, but it was started with `-Q <queue>.cleanup` only: the exporter
    counts it up and counts no worker on the other lanes, so LaneUnserved fires (for the
    acquire lane among them) and NoWorker does not; the module's worker, on every lane of
    its installation, leaves every lane served."""
    queue = f"lanes-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=own_stack.store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    try:
        stack.start_worker(concurrency=1, queues=[queue_name(queue, Lane.CLEANUP)])
        with running_exporter(tmp_path / "split.log", LEASEKEEPER_TASK_QUEUE=queue,
                              LEASEKEEPER_STORE_URL=own_stack.store_url,
                              LEASEKEEPER_BROKER_URL=redis_server.url,
                              LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="2") as exp:
            seen = eventually(lambda: answered(exp), 60, "the cleanup worker's answer")
    finally:
        stack.stop()
    assert {lane: seen.value("leasekeeper_lane_workers", lane=lane.value) for lane in Lane} == {
        Lane.CLEANUP: 1, Lane.SWEEPS: 0, Lane.DEFAULT: 0, Lane.ACQUIRE: 0, Lane.POOL: 0}
    series = {k: v for k, v in seen.found.items()
              if k[0].startswith("leasekeeper_") and not k[0].endswith("_created")}
    # promtool, told to expect none, lists the alerts that fired: one per unserved lane but
    # the pool lane (no warm pool is declared)
    said = replay(series, [{"eval_time": "6m", "alertname": "LaneUnserved", "exp_alerts": []}],
                  tmp_path)
    assert "FAILED:" in said.stdout + said.stderr, said.stdout + said.stderr
    assert set(re.findall(r'lane="(\w+)"', said.stdout + said.stderr)) == {
        "acquire", "default", "sweeps"}
    assert not fired(series, "NoWorker", tmp_path, at="6m")

    with running_exporter(tmp_path / "whole.log",
                          LEASEKEEPER_TASK_QUEUE=own_stack.env["LEASEKEEPER_TASK_QUEUE"],
                          LEASEKEEPER_STORE_URL=own_stack.store_url,
                          LEASEKEEPER_BROKER_URL=redis_server.url,
                          LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S="2") as exp:
        whole = eventually(lambda: answered(exp), 60, "the module's worker's answer")
    assert all(whole.value("leasekeeper_lane_workers", lane=lane.value) for lane in Lane)
    series = {k: v for k, v in whole.found.items()
              if k[0].startswith("leasekeeper_") and not k[0].endswith("_created")}
    assert not fired(series, "LaneUnserved", tmp_path, at="6m")
