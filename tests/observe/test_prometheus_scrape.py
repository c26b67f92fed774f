"""A real Prometheus scrapes `leasekeeper metrics` while leases move through a real worker,
and the values are read back through Prometheus' HTTP API (/api/v1/query)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from models.schema import LeaseState
from providers.errors import TerminalProviderError
from tasks import producer
from tests.e2e.conftest import eventually
from tests.observe.prometheus import running_prometheus
from tests.stack import WorkerStack
from workers.app import app

pytestmark = pytest.mark.timeout(300)


def rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def test_prometheus_reads_lease_metrics_while_leases_move(
        own_stack: WorkerStack, exporter: str, tmp_path: Path) -> None:
    store = own_stack.runtime().store
    with running_prometheus(tmp_path / "prometheus", [exporter]) as prom:
        prom.wait_value('up{job="leasekeeper"}', 1)
        prom.wait_value("leasekeeper_store_up", 1)
        prom.wait_true("leasekeeper_workers_up >= 1")  # a ping answered

        # Given leases of four tenants, two of one: with LEASEKEEPER_METRICS_TENANT_TOP_N=3
        # the fourth tenant is counted as "other".
        tenants = ["ta-" + uuid.uuid4().hex[:6], "tb", "tc", "td"]
        runs = [(rid(), tenants[0]), (rid(), tenants[0]),
                *[(rid(), t) for t in tenants[1:]]]
        leases = [producer.acquire_lease(run_id, {"tenant": tenant}) for run_id, tenant in runs]
        lease_ids = [result.get(90)["lease_id"] for result in leases]
        prom.wait_value(f'sum(leasekeeper_leases{{state="active",tenant="{tenants[0]}"}})', 2)
        prom.wait_value('sum(leasekeeper_leases{state="active",tenant="other"})', 1)
        # 3 tenants + other (each provider's series of them, 0 for a provider with none)
        assert len({s["metric"]["tenant"]
                    for s in prom.query('leasekeeper_leases{state="active"}')}) == 4
        assert len(prom.query('leasekeeper_leases{state="active"} > 0')) == 4
        prom.wait_value('leasekeeper_acquires_total{provider="local",outcome="active"}', 5)
        prom.wait_value('leasekeeper_acquire_duration_seconds_count{provider="local"}', 5)
        assert prom.value('leasekeeper_lease_transitions_total{from_state="provisioning",'
                          'to_state="active",provider="local"}') == 5
        # The histogram's sum is each lease's intent → active time, as its history says.
        expected_s = sum((e.at - store.get_lease(lease_id).created_at).total_seconds()
                         for lease_id in lease_ids for e in store.events(lease_id)
                         if e.to_state == LeaseState.ACTIVE)
        seen_s = prom.value('leasekeeper_acquire_duration_seconds_sum{provider="local"}')
        assert seen_s == pytest.approx(expected_s, abs=1e-3)

        # When one run finishes, its sandbox is reclaimed: a destroy and a reclaim outcome.
        producer.finish_run(runs[0][0], "completed", exit_code=0).get(60)
        prom.wait_value('leasekeeper_destroys_total{provider="local",outcome="destroyed"}', 1)
        prom.wait_value('leasekeeper_destroy_duration_seconds_count{provider="local",'
                        'outcome="destroyed"}', 1)
        prom.wait_value('leasekeeper_run_reclaims_total{outcome="destroyed"}', 1)
        assert prom.value('leasekeeper_run_reclaims_total{outcome="not-found"}') == 0
        prom.wait_value('leasekeeper_runs{status="running"}', 4)
        prom.wait_value(f'sum(leasekeeper_leases{{state="active",tenant="{tenants[0]}"}})', 1)
        assert prom.value('leasekeeper_lease_transitions_total{from_state="destroying",'
                          'to_state="destroyed",provider="local"}') == 1

        # When a sandbox's process dies, the resume check says so: not resumable, exited.
        victim = store.get_lease(lease_ids[4])
        os.killpg(int(victim.provider_meta["pid"]), signal.SIGKILL)
        eventually(lambda: producer.check_resumable(victim.lease_id).get(60)["resumable"]
                   is False, 60, "the resume check to see the process gone")
        prom.wait_value('leasekeeper_not_resumable_total{provider="local",'
                        'reason_class="exited"}', 1)
        prom.wait_value('leasekeeper_destroys_total{provider="local",outcome="destroyed"}', 2)

        # When an acquire fails for good, it is counted as failed.
        own_stack.faults.write({"acquire": [{"fault": "terminal", "when": "before", "times": 1}]})
        with pytest.raises(TerminalProviderError):
            producer.acquire_lease(rid(), {"provider": "faulty"}).get(90)
        prom.wait_value('leasekeeper_acquires_total{provider="faulty",outcome="failed"}', 1)
        prom.wait_value('leasekeeper_provider_errors_total{provider="faulty",'
                        'error_class="terminal",status="none"}', 1)

        # When a destroy fails at the attempt cap (1 here), the lease is abandoned: the
        # gauge and the LeaseAbandoned alert (pending for its 1m `for`) show it.
        own_stack.faults.write({"destroy": [{"fault": "terminal", "times": 1}]})
        doomed = producer.acquire_lease(rid(), {"provider": "faulty"}).get(90)["lease_id"]
        producer.destroy_lease(doomed)
        eventually(lambda: store.get_lease(doomed).state == LeaseState.ABANDONED, 60,
                   "the lease to be abandoned")
        prom.wait_value("leasekeeper_leases_abandoned", 1)
        prom.wait_value('leasekeeper_destroys_total{provider="faulty",outcome="abandoned"}', 1)
        prom.wait_value('count(ALERTS{alertname="LeaseAbandoned"})', 1)

        # A beat tick, sent by name as beat would: its run, outcomes and timestamp.
        app.send_task("sweep.retry_cleanup").get(60)
        prom.wait_value('leasekeeper_sweep_ticks_total{sweep="sweep.retry_cleanup",run="ran"}', 1)
        prom.wait_value('leasekeeper_sweep_tick_duration_seconds_count{'
                        'sweep="sweep.retry_cleanup"}', 1)
        assert prom.value('time() - leasekeeper_sweep_last_tick_timestamp_seconds{'
                          'sweep="sweep.retry_cleanup",run="ran"}') is not None
        # A ping can miss under load (NoWorker waits 2m for that); the worker was seen.
        assert (prom.value("max_over_time(leasekeeper_workers_up[10m])") or 0) >= 1
        for lease_id in lease_ids[1:4]:
            producer.destroy_lease(lease_id).get(60)
