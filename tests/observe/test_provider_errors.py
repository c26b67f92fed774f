"""Provider API errors are counted by class and HTTP status: every ProviderError a provider
call raises is one row of the store's provider error log (one per failed part of a
destroy), recorded at the provider boundary and never with its message; the exporter tails
the log into ``leasekeeper_provider_errors_total``."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from models.observe import Observe
from models.schema import LeaseState
from models.store import Store
from providers.errors import (
    AcquireCleanupIncomplete,
    DestroyIncomplete,
    PartFailure,
    TerminalProviderError,
    TransientProviderError,
)
from providers.faulty import FaultPlan, FaultyProvider
from providers.kubernetes.errors import kube_errors
from providers.local import LocalProvider
from tasks import producer
from tests.e2e.conftest import eventually
from tests.stack import WorkerStack
from workers.provider_errors import RecordingProvider, records_of

pytestmark = pytest.mark.timeout(300)


def _rows(store: Store) -> list[tuple[str, str, str | None, str, int | None, str]]:
    return [(r.provider, r.operation, r.task, r.error_class, r.status, r.error_type)
            for r in Observe(store).provider_errors_from(0, 1000)]


def test_provider_calls_record_each_error_and_the_log_keeps_the_newest(
        store_url: str, tmp_path: Path) -> None:
    store = Store(store_url)
    plan = FaultPlan(tmp_path / "faults.json")
    provider = RecordingProvider(
        FaultyProvider(LocalProvider(tmp_path / "sandboxes", "it-errors", 1), plan), store,
        keep=3)
    plan.write({"list_managed": [{"fault": "transient", "times": 1},
                                 {"fault": "terminal", "times": 1}]})
    with pytest.raises(TransientProviderError):
        provider.list_managed()
    with pytest.raises(TerminalProviderError):
        provider.list_managed()
    assert provider.list_managed() == []  # a call that succeeds records nothing
    assert _rows(store) == [
        ("faulty", "list_managed", None, "transient", None, "TransientProviderError"),
        ("faulty", "list_managed", None, "terminal", None, "TerminalProviderError")]

    # A destroy that failed in two parts is two API errors, with their HTTP statuses.
    with pytest.raises(TransientProviderError) as unavailable, \
            kube_errors("delete pod lk-a"):
        raise ApiException(status=503, reason="Service Unavailable")
    with pytest.raises(TerminalProviderError) as forbidden, kube_errors("delete secret lk-a"):
        raise ApiException(status=403, reason="Forbidden")
    assert (unavailable.value.status, forbidden.value.status) == (503, 403)
    incomplete = DestroyIncomplete.of("lk-a", [PartFailure("pod", unavailable.value),
                                               PartFailure("secret", forbidden.value)])
    Observe(store).record_provider_errors(
        records_of("kubernetes", "destroy", "lease.destroy", incomplete), keep=3)
    # An acquire whose cleanup failed too is the acquire's own API error.
    try:
        raise AcquireCleanupIncomplete.of("l-1", forbidden.value, unavailable.value) \
            from forbidden.value
    except AcquireCleanupIncomplete as exc:
        assert [(r.error_class, r.status) for r in records_of(
            "kubernetes", "acquire", None, exc)] == [("terminal", 403)]
    # Trimmed to the newest 3, like the sweep tick log.
    assert _rows(store) == [
        ("faulty", "list_managed", None, "terminal", None, "TerminalProviderError"),
        ("kubernetes", "destroy", "lease.destroy", "transient", 503, "TransientProviderError"),
        ("kubernetes", "destroy", "lease.destroy", "terminal", 403, "TerminalProviderError")]
    store.dispose()


def _scrape(exporter: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://{exporter}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {(s.labels["provider"], s.labels["error_class"], s.labels["status"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "leasekeeper_provider_errors"
            for s in family.samples if s.name == "leasekeeper_provider_errors_total"}


def test_a_worker_records_provider_errors_and_the_exporter_counts_them(
        own_stack: WorkerStack, exporter: str) -> None:
    store = own_stack.runtime().store
    first_id = Observe(store).max_provider_error_id() + 1
    before = _scrape(exporter)  # the exporter counts from its first scrape
    assert before[("faulty", "transient", "none")] == 0
    assert before[("faulty", "terminal", "none")] == 0

    # Given an acquire that fails twice transiently, then works on its last retry:
    own_stack.faults.write({"acquire": [{"fault": "transient", "when": "before", "times": 2}]})
    done = producer.acquire_lease(f"run-{uuid.uuid4().hex[:12]}",
                                  {"provider": "faulty"}).get(90)
    assert store.get_lease(done["lease_id"]).state == LeaseState.ACTIVE
    # and one that fails for good:
    own_stack.faults.write({"acquire": [{"fault": "terminal", "when": "before", "times": 1}]})
    with pytest.raises(TerminalProviderError):
        producer.acquire_lease(f"run-{uuid.uuid4().hex[:12]}", {"provider": "faulty"}).get(90)

    # then each attempt's error is one row, with no message text,
    rows = [(r.provider, r.operation, r.task, r.error_class, r.status, r.error_type)
            for r in Observe(store).provider_errors_from(first_id, 100)]
    assert rows == [("faulty", "acquire", "lease.acquire", "transient", None,
                     "TransientProviderError")] * 2 + [
        ("faulty", "acquire", "lease.acquire", "terminal", None, "TerminalProviderError")]
    # and the exporter counts each once.
    eventually(lambda: _scrape(exporter).get(("faulty", "transient", "none")) == 2, 60,
               "the exporter to count both transient errors")
    after = _scrape(exporter)
    assert after[("faulty", "terminal", "none")] == 1
    assert after[("local", "transient", "none")] == 0
    producer.destroy_lease(done["lease_id"]).get(60)

