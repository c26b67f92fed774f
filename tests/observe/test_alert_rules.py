"""deploy/prometheus/alerts.yml under promtool: the rules parse, and the unit tests in
deploy/prometheus/tests/ show every alert firing and not firing from realistic series."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observe.prometheus import ALERTS, binary

TESTS = sorted((ALERTS.parent / "tests").glob("*.yml"))
REQUIRED = {"LeaseAbandoned", "CleanupBacklogGrowing", "SweepStalled", "OrphansFound",
            "AcquireFailureRateHigh", "AcquireLatencyHigh", "NoWorker", "PoolBreakerOpen",
            "MetricsStoreUnreadable", "BrokerDown", "MetricsExporterDown", "LaneUnserved"}


def rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *map(str, args)], capture_output=True, text=True,
                          cwd=ALERTS.parent, check=False)


def test_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", ALERTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_every_alert_fires_and_stays_quiet_in_promtool_unit_tests() -> None:
    done = promtool("test", "rules", *TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(TESTS)
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case["alert_rule_test"]:
                (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert set(rules()) >= REQUIRED
    assert fired == set(rules()), f"alerts never shown firing: {set(rules()) - fired}"
    assert quiet == set(rules()), f"alerts never shown quiet: {set(rules()) - quiet}"


def test_every_alert_has_a_runbook_naming_a_command() -> None:
    for name, rule in rules().items():
        runbook = rule["annotations"]["runbook"]
        assert "`leasekeeper " in runbook or "`celery " in runbook, name

