"""``null`` in an acquire spec: every optional field given as null is the default, exactly
as if it were left out (a JSON client serialises an absent optional as null), for the spec
the worker validates, the payload the producer sends, the stored spec and the sandbox key
(a repeat with nulls is the same spec). Wrong types are still refused. On SQLite and
PostgreSQL, over real sandboxes (noop and local)."""

from __future__ import annotations

from typing import Any

import pytest

from providers.errors import InvalidRequest
from providers.spec import DEFAULT_TENANT, SandboxSpec, parse_spec
from tasks.acquire import AcquireResult, acquire_lease, parse_acquire
from tasks.leases import sandbox_key
from workers.pool_settings import parse_pools, resolve_spec
from workers.runtime import Runtime

# Every field of the spec (all are optional: README "Enqueueing from a web backend")
FIELDS = sorted(SandboxSpec.model_fields)
BASE: dict[str, Any] = {"tenant": "acme", "thread_id": "t-1", "env": {"MODE": "a"}}


@pytest.mark.parametrize("field", FIELDS)
def test_a_null_field_is_the_field_left_out(field: str) -> None:
    for given in ({}, {k: v for k, v in BASE.items() if k != field}):
        with_null = parse_acquire("run-1", {**given, field: None})[1]
        without = parse_acquire("run-1", given)[1]
        assert with_null == without, field
        assert with_null.to_payload() == without.to_payload()  # what the producer sends
        assert with_null.redacted() == without.redacted()  # what the lease stores
        assert with_null.model_fields_set == without.model_fields_set  # a pool's tenant
        assert sandbox_key(with_null, "noop", "run-1") == sandbox_key(without, "noop", "run-1")


def test_every_field_null_at_once_is_the_default_spec() -> None:
    spec = parse_acquire("run-1", dict.fromkeys(FIELDS))[1]
    assert spec == SandboxSpec() and spec.to_payload() == {}
    nested = parse_acquire("run-1", {"resources": dict.fromkeys(
        ("cpu_request", "memory_request", "cpu_limit", "memory_limit"))})[1]
    assert nested.resources is not None and nested.to_payload() == {"resources": {}}


@pytest.mark.parametrize(("spec", "message"), [
    ({"tenant": 5}, r"tenant: Input should be a valid string"),
    ({"reuse": "yes"}, r"reuse: Input should be a valid boolean"),
    ({"env": ["A=1"]}, r"env: Input should be a valid dictionary"),
    # null inside a mapping or a list is a value, not a field left out
    ({"env": {"A": None}}, r"env\.A: Input should be a valid string"),
    ({"labels": {"team": None}}, r"labels\.team: Input should be a valid string"),
    ({"secret_env": {"TOKEN": None}}, r"secret_env\.TOKEN: Input should be a valid string"),
    ({"command": ["echo", None]}, r"command\.1: Input should be a valid string"),
    # an unknown field is refused, null or not: a typo still fails loudly
    ({"tenat": None}, r"tenat: Extra inputs are not permitted"),
])
def test_wrong_types_and_unknown_fields_are_still_refused(spec: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_acquire("run-1", spec)


def test_a_null_tenant_takes_the_pools_as_a_left_out_one_does() -> None:
    pools = parse_pools([{"name": "py", "provider": "noop", "size": 1,
                          "template": {"tenant": "acme"}}], "LEASEKEEPER_POOLS")
    for spec in ({"pool": "py"}, {"pool": "py", "tenant": None}):
        assert resolve_spec(pools, parse_acquire("run-1", spec)[1]).tenant == "acme", spec


@pytest.mark.parametrize("reuse", [False, True])
def test_an_acquire_repeated_with_nulls_is_already_acquired(rt: Runtime, reuse: bool) -> None:
    given: dict[str, Any] = {"provider": "noop", "thread_id": "t-1",
                             **({"reuse": True} if reuse else {})}
    nulls = {**dict.fromkeys(FIELDS), **given}
    first = acquire_lease(rt, "run-1", parse_acquire("run-1", nulls)[1], None, may_retry=False)
    again = acquire_lease(rt, "run-1", parse_acquire("run-1", given)[1], None, may_retry=False)
    assert (again.result, again.lease_id) == (AcquireResult.ALREADY_ACQUIRED, first.lease_id)
    assert again.sandbox_key == first.sandbox_key
    # and the other way round: a spec without nulls first, a repeat with them
    other = {**given, "thread_id": "t-2"}
    first = acquire_lease(rt, "run-2", parse_acquire("run-2", other)[1], None, may_retry=False)
    again = acquire_lease(rt, "run-2", parse_acquire("run-2", {**dict.fromkeys(FIELDS), **other}
                                                     )[1], None, may_retry=False)
    assert (again.result, again.lease_id) == (AcquireResult.ALREADY_ACQUIRED, first.lease_id)
    assert rt.store.get_lease(first.lease_id).spec == parse_acquire("r", other)[1].redacted()


def test_a_known_provider_not_enabled_says_so_and_how_to_enable_it(rt: Runtime) -> None:
    # rt enables local, faulty and noop: kubernetes is leasekeeper's, not this worker's
    with pytest.raises(InvalidRequest) as err:
        rt.provider("kubernetes")
    assert str(err.value) == (
        "provider 'kubernetes' is not enabled on this worker (it enables local, faulty, "
        "noop): add it to LEASEKEEPER_PROVIDERS to use it")
    # a name no leasekeeper has is unknown, as before
    with pytest.raises(InvalidRequest) as err:
        rt.provider("nomad")
    assert str(err.value) == ("unknown provider 'nomad': this installation enables local, "
                              "faulty, noop (LEASEKEEPER_PROVIDERS)")
    assert rt.store.leases() == []


def test_a_tenant_given_as_the_default_reaches_the_worker_as_given() -> None:
    # Before: the producer's payload dropped it (it equals the default), so with a pool the
    # worker gave the run the template's tenant; sent by name it kept "default".
    spec = parse_spec({"pool": "py", "tenant": DEFAULT_TENANT})
    payload = spec.to_payload()
    assert payload == {"pool": "py", "tenant": DEFAULT_TENANT}
    assert "tenant" in parse_spec(payload).model_fields_set
    assert parse_spec({"pool": "py"}).to_payload() == {"pool": "py"}  # left out: not sent
