"""Owns the manual-use CLI of the cluster harness.

``python -m tests.cluster up [--rbac] [--no-sim]`` builds or locates the binaries, starts the
cluster (plus the kubelet and Sandbox controller simulators unless ``--no-sim``), prints
``KUBECONFIG=<path>`` and runs until SIGTERM or Ctrl-C, then stops everything it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from contextlib import ExitStack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a test cluster and keep it running until SIGTERM")
    up.add_argument("--rbac", action="store_true", help="authorization mode RBAC")
    up.add_argument("--no-sim", action="store_true", help="no kubelet / Sandbox simulators")
    sub.add_parser("build", help="build or locate the binaries and print their directory")
    args = parser.parse_args(argv)

    from tests.cluster.binaries import locate_binaries

    bin_dir = locate_binaries()
    if args.command == "build":
        print(bin_dir)
        return 0

    from tests.cluster.cluster import KubeCluster
    from tests.cluster.kubelet_sim import KubeletSim
    from tests.cluster.sandbox_controller import SandboxController, install_sandbox_crd

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with ExitStack() as stack:
        cluster = stack.enter_context(
            KubeCluster(bin_dir, authorization_mode="RBAC" if args.rbac else "AlwaysAllow",
                        before_controllers=None if args.no_sim else install_sandbox_crd))
        if not args.no_sim:
            api = stack.enter_context(cluster.api_client())
            stack.enter_context(KubeletSim(api, cert_dir=cluster.workdir / "kubelet"))
            stack.enter_context(SandboxController(api))
        print(f"KUBECONFIG={cluster.kubeconfig_path}", flush=True)
        print(f"# admin token: {cluster.admin_token}  api: {cluster.api_url}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
