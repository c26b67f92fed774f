"""Owns the tests of the fault proxy's rules beyond plain errors: 429 with Retry-After, dropped
connections, delays, holds, counted watches and cutting open streams."""

from __future__ import annotations

import json
import threading
import time

import pytest
import urllib3
from kubernetes import client, config, watch

from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.k8s_json import body
from tests.cluster.kubeconfig import api_client_from_kubeconfig

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]


def _client(proxy: FaultProxy, retries: int | None = None) -> client.ApiClient:
    """A client through the proxy; ``retries=0`` turns off urllib3's own retries."""
    configuration = client.Configuration()
    configuration.retries = retries
    api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(proxy.kubeconfig_path), client_configuration=configuration)
    return api


def test_throttle_answers_429_with_retry_after(fault_proxy: FaultProxy,
                                                k8s_namespace: str) -> None:
    with _client(fault_proxy, retries=0) as api:
        fault_proxy.throttle("GET", r"/configmaps$", retry_after=3, times=1)
        with pytest.raises(client.ApiException) as info:
            client.CoreV1Api(api).list_namespaced_config_map(k8s_namespace)
        assert info.value.status == 429
        assert info.value.headers is not None and info.value.headers["Retry-After"] == "3"
        status = json.loads(info.value.body or "{}")
        assert status["reason"] == "TooManyRequests"
        assert status["details"]["retryAfterSeconds"] == 3


def test_default_client_retries_429_after_retry_after(fault_proxy: FaultProxy,
                                                      k8s_namespace: str) -> None:
    # urllib3's default Retry honours Retry-After on 429 for GETs: the client waits and retries
    with _client(fault_proxy) as api:
        fault_proxy.reset_counts()
        fault_proxy.throttle("GET", r"/configmaps$", retry_after=1, times=1)
        started = time.monotonic()
        client.CoreV1Api(api).list_namespaced_config_map(k8s_namespace)
        assert time.monotonic() - started >= 1
        assert fault_proxy.count("GET", r"/configmaps$") == 2


def test_drop_and_delay(fault_proxy: FaultProxy, k8s_namespace: str) -> None:
    with _client(fault_proxy, retries=0) as api:
        core = client.CoreV1Api(api)
        fault_proxy.drop("GET", r"/secrets$", times=1)
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.list_namespaced_secret(k8s_namespace)
        fault_proxy.delay("GET", r"/secrets$", seconds=0.5)
        started = time.monotonic()
        core.list_namespaced_secret(k8s_namespace)
        assert time.monotonic() - started >= 0.5
        assert fault_proxy.count("GET", r"/secrets$") == 2


def test_hold_keeps_a_request_in_flight_until_released(fault_proxy: FaultProxy,
                                                       k8s_namespace: str) -> None:
    # given a create held by the proxy
    with _client(fault_proxy, retries=0) as api:
        core = client.CoreV1Api(api)
        held = fault_proxy.hold("POST", r"/configmaps$")
        answers: list[object] = []
        sender = threading.Thread(target=lambda: answers.append(core.create_namespaced_config_map(
            k8s_namespace, {"metadata": {"name": "held"}})))
        sender.start()
        assert held.arrived.wait(30)
        # then nothing reached the API server while it is held
        with pytest.raises(client.ApiException) as missing:
            core.read_namespaced_config_map("held", k8s_namespace)
        assert missing.value.status == 404 and not answers
        # and once released it is forwarded and answered
        held.released.set()
        sender.join(30)
        assert len(answers) == 1
        assert core.read_namespaced_config_map("held", k8s_namespace).metadata.name == "held"


def test_watch_streams_through_and_close_streams_cuts_it(fault_proxy: FaultProxy,
                                                         k8s_namespace: str) -> None:
    with api_client_from_kubeconfig(fault_proxy.kubeconfig_path) as api:
        core = client.CoreV1Api(api)
        seen: list[str] = []
        ended = threading.Event()

        def watch_config_maps() -> None:
            try:
                events = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    core.list_namespaced_config_map, k8s_namespace, timeout_seconds=60)
                for event in events:
                    seen.append(event["object"].metadata.name)
            except Exception:
                pass
            finally:
                ended.set()

        thread = threading.Thread(target=watch_config_maps, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while fault_proxy.count("GET", r"/configmaps$", query="watch=") == 0:
            assert time.monotonic() < deadline, "the watch never reached the proxy"
            time.sleep(0.02)
        core.create_namespaced_config_map(k8s_namespace, body({"metadata": {"name": "cm1"}}))
        deadline = time.monotonic() + 10
        while "cm1" not in seen:
            assert time.monotonic() < deadline, "the watch event did not stream through"
            time.sleep(0.02)
        fault_proxy.close_streams()
        assert ended.wait(10), "close_streams() did not end the watch"
