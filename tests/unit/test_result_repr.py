"""workers/result_repr.py: the text of a task's result in its log line and its
task-succeeded event is exactly what Celery's saferepr writes, whichever path made it, and
Celery's tracer renders results with it once installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celery.app.trace as celery_trace
import pytest
from celery import Celery
from celery.signals import worker_init
from celery.utils.saferepr import saferepr
from hypothesis import given, settings
from hypothesis import strategies as st

from models.schema import LeaseState
from workers import result_repr as rr

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(max_size=40))
VALUES = st.recursive(SCALARS, lambda inner: (
    st.lists(inner, max_size=6) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=12), inner, max_size=6)), max_leaves=30)


@given(VALUES, st.sampled_from([None, 16, 80, 1024]))
@settings(max_examples=600, deadline=None)
def test_the_text_is_saferepr_for_any_json_like_value(value: Any, maxlen: int | None) -> None:
    assert rr.result_repr(value, maxlen) == saferepr(value, maxlen)


@pytest.mark.parametrize("value", [-447333805507829, 1818512063913950, 1.5e-05 * 10, None])
def test_a_scalar_exactly_as_long_as_maxlen_is_cut_as_saferepr_cuts_it(value: Any) -> None:
    # (hypothesis found the first: saferepr writes "-447333805507829..." at maxlen 16)
    maxlen = len(repr(value))
    assert rr.result_repr(value, maxlen) == saferepr(value, maxlen)


RESULTS: list[Any] = [
    {"result": "acquired", "run_id": "run-42", "lease_id": "019ae4a1b2c3d4e5f6a7b8c9d0e1f2a3",
     "provider": "noop", "provider_lease_id": "lk-019ae4a1b2c3d4e5f6a7b8c9d0e1f2a3",
     "backend": None, "sandbox_key": "sk-" + "a" * 40, "state": "active"},
    {"lease_id": "019ae4a1b2c3d4e5f6a7b8c9d0e1f2a3", "result": "destroyed", "state": "destroyed"},
    {"run": "ran", "took_ms": 12, "expired": 3, "items": ["l-1", "l-2"]},
    "pong",
]


@pytest.mark.parametrize("value", RESULTS, ids=["acquire", "destroy", "sweep", "ping"])
def test_our_results_take_the_cheap_path(value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: Any) -> str:
        raise AssertionError("saferepr was called for a plain result")

    monkeypatch.setattr(rr, "saferepr", fail)
    assert rr.result_repr(value, 1024) == saferepr(value, 1024)


@pytest.mark.parametrize("value", [
    "it's", "back\\slash", "new\nline", {"k": [[["deep"]]]}, {1: "int key"}, "x" * 2000,
    {"enum": LeaseState.ACTIVE}, object(),
], ids=["quote", "backslash", "newline", "deep", "int-key", "long", "str-subclass", "object"])
def test_anything_else_is_saferepr_itself(value: Any) -> None:
    assert rr.result_repr(value, 1024) == saferepr(value, 1024)


@pytest.fixture
def installed() -> Iterator[None]:
    before = celery_trace.saferepr
    rr.install()
    rr.install()  # idempotent
    yield
    celery_trace.saferepr = before


def test_celerys_tracer_renders_results_with_it(installed: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the seam: if a Celery release stops looking up ``saferepr`` in its tracer
    module, results would silently take the costly path again."""
    seen: list[Any] = []

    def counting(value: Any, maxlen: int | None = None, *rest: Any) -> str:
        seen.append(value)
        return rr.result_repr(value, maxlen, *rest)

    assert celery_trace.saferepr is rr.result_repr
    monkeypatch.setattr(celery_trace, "saferepr", counting)
    app = Celery("result-repr-test", set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(name="t.result")
    def result() -> dict[str, str]:
        return {"result": "destroyed"}

    assert result.apply().get() == {"result": "destroyed"}
    assert seen == [{"result": "destroyed"}]


def test_the_worker_installs_it_before_its_pool_forks() -> None:
    import workers.app as worker_app

    assert worker_app._cheap_result_reprs in [ref() for _, ref in worker_init.receivers]
