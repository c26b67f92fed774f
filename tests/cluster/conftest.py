"""Owns the pytest wiring of tests/cluster: makes the harness fixtures available here."""

from tests.cluster.fixtures import (  # noqa: F401
    fault_proxy,
    k8s_namespace,
    kube_api,
    kube_cluster,
    kubelet_sim,
    sandbox_controller,
)
