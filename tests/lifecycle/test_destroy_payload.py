"""lease.destroy's ``reason`` as a JSON client sends it: a string, or null for "none given"
(the default, as run.finish takes ``error: null``); anything else is refused, naming the
field. Through the task itself (its payload check), over a real store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from models.schema import LeaseState
from providers.errors import InvalidRequest
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tasks.destroy import DEFAULT_REASON, destroy
from workers.runtime import Runtime, set_runtime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def current(rt: Runtime) -> Iterator[Runtime]:
    set_runtime(rt)
    yield rt
    set_runtime(None)


def test_a_null_reason_is_the_default_reason(current: Runtime) -> None:
    # Before (a QA pass): "invalid lease.destroy payload: reason must be a string; got
    # NoneType", though the README calls the reason optional.
    lease_id = acquire_lease(current, "run-1", SandboxSpec(), None, False).lease_id
    done = destroy(lease_id=lease_id, reason=None)
    assert (done["result"], done["state"]) == ("destroyed", LeaseState.DESTROYED)
    assert current.store.get_lease(lease_id).end_reason == DEFAULT_REASON


@pytest.mark.parametrize("reason", [{}, 5, ["x"]])
def test_a_reason_that_is_no_string_is_refused_naming_the_field(
    current: Runtime, reason: object
) -> None:
    lease_id = acquire_lease(current, "run-1", SandboxSpec(), None, False).lease_id
    with pytest.raises(InvalidRequest, match="reason must be a string or null; got "):
        destroy(lease_id=lease_id, reason=reason)
    assert current.store.get_lease(lease_id).state == LeaseState.ACTIVE
