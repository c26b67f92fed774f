"""The exporter's counters count what happened since the exporter started, not since its
first scrape: a lease acquired between the start and the first scrape is counted. Before,
the first scrape only marked where the logs stood, so those events were never counted."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.observe.conftest import leasekeeper_process
from tests.observe.exporter import Samples
from tests.services import free_port
from tests.stack import WorkerStack

pytestmark = pytest.mark.timeout(240)


def scrape(address: str) -> Samples:
    from tests.observe.exporter import Exporter

    return Exporter(address, Path("/dev/null")).scrape()


def test_events_before_the_first_scrape_are_counted(own_stack: WorkerStack,
                                                    tmp_path: Path) -> None:
    from tasks import producer

    port = free_port()
    env = {"LEASEKEEPER_METRICS_PORT": str(port),
           "LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S": "0.5"}
    with leasekeeper_process(own_stack, "metrics", env, port, tmp_path / "exporter.log"):
        tenant = f"early-{uuid.uuid4().hex[:8]}"
        leases = [producer.acquire_lease(f"{tenant}-{i}", {"tenant": tenant,
                                                           "provider": "noop"}).get(120)
                  for i in range(2)]
        assert [lease["state"] for lease in leases] == ["active", "active"]
        first = scrape(f"127.0.0.1:{port}")  # the first scrape, after both acquires
        assert first.value("leasekeeper_store_up") == 1
        assert first.total("leasekeeper_lease_transitions_total", from_state="provisioning",
                           to_state="active", provider="noop") == 2
        assert first.total("leasekeeper_acquires_total", provider="noop",
                           outcome="active") == 2


def test_every_known_counter_series_is_there_at_zero_before_any_event(
        own_stack: WorkerStack, tmp_path: Path) -> None:
    """Before: leasekeeper_not_resumable_total, leasekeeper_lease_transitions_total and
    leasekeeper_sweep_ticks_total{run="skipped"|"failed"} had no series until their first
    event, so increase()/rate() missed that event (a QA pass)."""
    from models.schema import LEASE_TRANSITIONS
    from workers.beat import SWEEPS
    from workers.metrics.collector import REASON_CLASSES

    port = free_port()
    env = {"LEASEKEEPER_METRICS_PORT": str(port),
           "LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S": "0.5"}
    with leasekeeper_process(own_stack, "metrics", env, port, tmp_path / "exporter.log"):
        first = scrape(f"127.0.0.1:{port}")  # no event since the exporter started
    providers = first.labels("leasekeeper_acquires_total", "provider")
    assert providers and providers >= {"noop", "local"}, providers
    for provider in providers:
        for reason in [*(name for name, _ in REASON_CLASSES), "other"]:
            assert first.value("leasekeeper_not_resumable_total", provider=provider,
                               reason_class=reason) == 0, (provider, reason)
        for frm, to in LEASE_TRANSITIONS:
            assert first.value("leasekeeper_lease_transitions_total", provider=provider,
                               from_state=frm or "none", to_state=to) == 0, (frm, to)
    for sweep in SWEEPS:
        for run in ("ran", "skipped", "failed"):
            assert first.value("leasekeeper_sweep_ticks_total", sweep=sweep, run=run) == 0, \
                (sweep, run)
    # bounded: only the pairs the lifecycle has, only the configured providers
    assert (len([k for (name, k) in first.found if name == "leasekeeper_lease_transitions_total"])
            == len(LEASE_TRANSITIONS) * len(providers))
