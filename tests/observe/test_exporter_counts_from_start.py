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
