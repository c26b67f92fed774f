"""The producer's refusal of a spec never quotes the spec's secret values: a web backend
shows it (a 422's body, an error tracker), and the worker refusing the same spec hides them
(a QA pass: the producer quoted them in four refusals)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from providers.errors import InvalidRequest
from tasks import producer

pytestmark = pytest.mark.timeout(30)

SECRET = f"Pa55w0rd-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("spec", [
    {"provider": SECRET},
    {"resources": {"cpu_request": SECRET}},
    {"resources": {"memory_limit": SECRET}},
    {"labels": {SECRET + "!": "x"}},
    {"env": {SECRET: "x"}},
], ids=["provider", "cpu", "memory", "label-key", "env-name"])
def test_a_refusal_hides_the_specs_secret_values(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        producer.acquire_lease(f"run-{uuid.uuid4().hex[:8]}",
                               {**spec, "secret_env": {"API_TOKEN": SECRET}})
    message = str(refused.value)
    assert SECRET not in message and "***" in message, message


def test_a_short_secret_is_hidden_where_quoted_whole() -> None:
    with pytest.raises(InvalidRequest) as refused:
        producer.acquire_lease("run-short", {"provider": "qz7k8",
                                             "secret_env": {"K": "qz7k8"}})
    assert "qz7k8" not in str(refused.value), str(refused.value)


def test_a_refusal_without_secrets_still_quotes_the_value() -> None:
    with pytest.raises(InvalidRequest, match="'lots' is not a Kubernetes quantity"):
        producer.acquire_lease("run-plain", {"resources": {"cpu_request": "lots"}})
