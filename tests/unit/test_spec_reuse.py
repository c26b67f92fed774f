"""A reusing spec must say whose sandbox it reuses (providers/spec.py): without a
thread_id or a sandbox_key its reuse key is the tenant's alone, so every reusing run of the
tenant would share one sandbox, holding the first run's env and secrets."""

from __future__ import annotations

import pytest

from providers.errors import InvalidRequest
from providers.spec import SandboxSpec, parse_spec
from tasks import producer
from tasks.acquire import parse_acquire


@pytest.mark.parametrize("spec", [
    {"reuse": True},
    {"reuse": True, "tenant": "acme", "secret_env": {"TOKEN": "t-123456"}},
], ids=["bare", "with-tenant-and-secret"])
def test_reuse_without_thread_or_key_is_refused_with_the_reason(spec: dict[str, object]
                                                                ) -> None:
    with pytest.raises(ValueError, match="reuse needs thread_id or sandbox_key"):
        parse_spec(spec)
    with pytest.raises(InvalidRequest, match=r"invalid lease\.acquire payload: .*reuse needs "
                                             r"thread_id or sandbox_key") as err:
        parse_acquire("run-1", spec)
    assert "t-123456" not in str(err.value)


def test_the_producer_refuses_it_before_anything_is_sent() -> None:
    # validation comes first: no broker is asked (none need be running)
    with pytest.raises(InvalidRequest, match="reuse needs thread_id or sandbox_key"):
        producer.acquire_lease("run-1", {"reuse": True})
    with pytest.raises(InvalidRequest, match="reuse needs thread_id or sandbox_key"):
        producer.acquire_lease("run-1", {"reuse": True, "tenant": "acme"})


@pytest.mark.parametrize("spec", [
    {"reuse": True, "thread_id": "th-1"},
    {"reuse": True, "sandbox_key": "key-1"},
    {"reuse": False},
    {},
])
def test_reuse_with_a_thread_or_a_key_and_no_reuse_are_accepted(spec: dict[str, object]
                                                                ) -> None:
    assert isinstance(parse_spec(spec), SandboxSpec)
