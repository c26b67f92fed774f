"""Ids, tenant, pool, labels and env names that end in a newline are refused where a web
backend's payload is checked: the producer API, the acquire's spec, every task's id
fields (a ``$`` in a pattern matches before a final newline; the checks match whole
strings)."""

from __future__ import annotations

from typing import Any

import pytest

from providers.errors import InvalidRequest

pytestmark = pytest.mark.timeout(60)

BAD_SPECS: list[dict[str, Any]] = [
    {"tenant": "acme\n"},
    {"pool": "py\n"},
    {"thread_id": "thread-1\n"},
    {"sandbox_key": "key-1\n"},
    {"labels": {"team\n": "a"}},
    {"labels": {"team": "a\n"}},
    {"labels": {"example.com/team\n": "a"}},
    {"env": {"NAME\n": "x"}},
    {"secret_env": {"TOKEN\n": "x"}},
    {"resources": {"cpu_limit": "1\n"}},
]


@pytest.mark.parametrize("spec", BAD_SPECS, ids=lambda s: next(iter(s)))
def test_a_spec_field_ending_in_a_newline_is_refused(spec: dict[str, Any]) -> None:
    from tasks.acquire import parse_acquire

    with pytest.raises(InvalidRequest, match=r"invalid lease\.acquire payload"):
        parse_acquire("run-1", spec)


@pytest.mark.parametrize("call", ["acquire", "finish", "detach", "touch", "destroy"])
def test_an_id_ending_in_a_newline_is_refused_before_anything_is_sent(call: str) -> None:
    from tasks import producer

    calls = {"acquire": lambda: producer.acquire_lease("run-1\n", {}),
             "finish": lambda: producer.finish_run("run-1\n", "completed", 0),
             "detach": lambda: producer.detach_run("run-1\n"),
             "touch": lambda: producer.touch_lease("lease-1\n"),
             "destroy": lambda: producer.destroy_lease("lease-1\n")}
    with pytest.raises(InvalidRequest, match=r"must be 1-128 characters.*'(run|lease)-1\\n'"):
        calls[call]()


def test_a_task_payload_by_name_with_such_an_id_is_refused() -> None:
    from tasks.base import check_payload
    from tasks.runs import finish_run

    with pytest.raises(InvalidRequest, match=r"invalid run\.finish payload: run_id must be"):
        check_payload("run.finish", finish_run.run, (),
                      {"run_id": "run-1\n", "status": "completed"}, 65536)


def test_the_same_values_without_the_newline_are_accepted() -> None:
    from tasks.acquire import parse_acquire

    run_id, spec = parse_acquire("run-1", {
        "tenant": "acme", "thread_id": "thread-1", "sandbox_key": "key-1",
        "labels": {"example.com/team": "a"}, "env": {"NAME": "x"},
        "secret_env": {"TOKEN": "x"}, "resources": {"cpu_limit": "1"}})
    assert (run_id, spec.tenant, spec.labels) == ("run-1", "acme", {"example.com/team": "a"})
