"""Owns the tests that every name, label, variable-name and id check matches the whole value:
``re.match`` with a ``$`` anchor accepts a trailing newline ("abc\\n"), so each check is a
``fullmatch``: the acquire's spec, the producer API and task payloads sent by name, the
Kubernetes provider's boundary, a claim's delivery, and the settings, where an installation
id read from a mounted file ends in a newline."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from providers.base import AcquireRequest, ClaimRequest
from providers.errors import ConfigError, InvalidRequest
from providers.kubernetes.delivery import build_delivery
from providers.kubernetes.manifests import WorkloadDefaults, is_label_key, label_value
from providers.kubernetes.provider import KubernetesProvider
from providers.spec import SandboxSpec, check_id
from workers.settings import Settings, load_settings

pytestmark = pytest.mark.timeout(30)

DEFAULTS = WorkloadDefaults(namespace="ns", image="busybox", cpu_request="100m",
                            memory_request="64Mi", cpu_limit="1", memory_limit="256Mi")


BAD_SPECS: list[dict[str, Any]] = [
    {"tenant": "acme\n"},
    {"pool": "warm-py\n"},
    {"thread_id": "thread-1\n"},
    {"sandbox_key": "key-1\n"},
    {"labels": {"team\n": "core"}},
    {"labels": {"team": "core\n"}},
    {"labels": {"example.com/team\n": "core"}},
    {"env": {"GREETING\n": "hi"}},
    {"secret_env": {"API_KEY\n": "x"}},
    {"resources": {"cpu_limit": "500m\n"}},
]


@pytest.mark.parametrize("spec", BAD_SPECS, ids=lambda s: next(iter(s)))
def test_an_acquire_spec_field_ending_in_a_newline_is_refused(spec: dict[str, Any]) -> None:
    from tasks.acquire import parse_acquire

    with pytest.raises(InvalidRequest, match=r"invalid lease\.acquire payload"):
        parse_acquire("run-1", spec)


def test_the_same_values_without_the_newline_are_accepted() -> None:
    from tasks.acquire import parse_acquire

    run_id, spec = parse_acquire("run-1", {
        "tenant": "acme", "thread_id": "thread-1", "sandbox_key": "key-1",
        "labels": {"example.com/team": "a"}, "env": {"NAME": "x"},
        "secret_env": {"TOKEN": "x"}, "resources": {"cpu_limit": "1"}})
    assert (run_id, spec.tenant, spec.labels) == ("run-1", "acme", {"example.com/team": "a"})


@pytest.mark.parametrize("call", ["acquire", "finish", "detach", "touch", "destroy"])
def test_an_id_ending_in_a_newline_is_refused_before_anything_is_sent(call: str) -> None:
    from tasks import producer

    calls = {"acquire": lambda: producer.acquire_lease("run-1\n", {}),
             "finish": lambda: producer.finish_run("run-1\n", "completed", 0),
             "detach": lambda: producer.detach_run("run-1\n"),
             "touch": lambda: producer.touch_lease("lease-1\n"),
             "destroy": lambda: producer.destroy_lease("lease-1\n")}
    # a refused id is described, never quoted (it may hold a secret): 6 or 8 characters,
    # the newline counted
    with pytest.raises(InvalidRequest,
                       match=r"must be 1-128 characters.*got a string of [68] characters"):
        calls[call]()


def test_a_task_payload_by_name_with_such_an_id_is_refused() -> None:
    from tasks.base import check_payload
    from tasks.runs import finish_run

    with pytest.raises(InvalidRequest, match=r"invalid run\.finish payload: run_id must be"):
        check_payload("run.finish", finish_run.run, (),
                      {"run_id": "run-1\n", "status": "completed"}, 65536)


def test_an_id_with_a_trailing_newline_is_refused() -> None:
    assert check_id("run id", "run-1") == "run-1"
    with pytest.raises(ValueError, match="run id must be"):
        check_id("run id", "run-1\n")


def test_the_kubernetes_label_helpers_match_the_whole_value() -> None:
    assert is_label_key("example.com/team")
    assert not is_label_key("team\n")
    assert not is_label_key("example.com\n/team")
    assert label_value("core") == "core"
    assert label_value("core\n").startswith("core-")  # slugged, never sent as is


def _identity_error(name: str, labels: dict[str, str]) -> str:
    provider = KubernetesProvider(None, DEFAULTS, "it")  # type: ignore[arg-type]
    request = AcquireRequest(lease_id="lease-1", name=name, spec=SandboxSpec(tenant="acme"),
                             labels=labels, timeout_s=5)
    with pytest.raises(InvalidRequest) as err:
        provider._identity(request)
    return str(err.value)


def test_the_provider_refuses_a_lease_name_or_label_key_with_a_trailing_newline() -> None:
    assert "is not a DNS-1123 label" in _identity_error("lk-abc\n", {})
    assert "is not a valid label key" in _identity_error("lk-abc", {"team\n": "core"})


@pytest.mark.parametrize(("run_id", "env", "says"), [
    ("run-1\n", {}, "is not a run id"),
    ("run-1", {"GREETING\n": "hi"}, "is not a valid variable name"),
])
def test_a_claim_refuses_a_run_id_or_variable_name_with_a_trailing_newline(
        run_id: str, env: dict[str, str], says: str) -> None:
    request = ClaimRequest(lease_id="lease-1", run_id=run_id, tenant="acme", labels={},
                           env=env, secret_env={})
    with pytest.raises(InvalidRequest, match=says):
        build_delivery(request)


def test_an_installation_id_read_from_a_file_is_refused_at_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # given LEASEKEEPER_INSTALLATION_ID set from a mounted file, its newline kept
    monkeypatch.setenv("LEASEKEEPER_INSTALLATION_ID", "prod-eu\n")
    # when the settings are read; then they are refused, saying what is wrong and the fix
    with pytest.raises(ConfigError) as err:
        load_settings(read_env_file=False)
    message = str(err.value)
    assert "LEASEKEEPER_INSTALLATION_ID" in message
    assert "'prod-eu\\n'" in message and "trailing newline" in message
    with pytest.raises(ValidationError, match="must be 1-42 lowercase"):
        Settings(installation_id="prod_eu")
    assert Settings(installation_id="prod-eu").installation_id == "prod-eu"
