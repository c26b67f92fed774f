"""deploy/'s in-cluster deployment, as `kubectl apply -k deploy/overlays/<backend>` sends it:
rendered with `kubectl kustomize`, checked for what operators rely on (grace above the soft
time limit, one Recreate beat, probes, resources, Flower's auth from the Secret, the PDB),
then sent to the real API server (tests/cluster): every object through a server-side dry
run (schemas validated, nothing created), then applied for real, and the controllers act
on them (the Deployments get their pods, the migration Job its pod).

Only what a test cluster needs is rewritten: a fresh namespace instead of `leasekeeper`
(as `kustomize edit set namespace` would), the Secret's URLs (loopback), and on a 1.20 API
server (no policy/v1) the
PodDisruptionBudget's apiVersion to policy/v1beta1 (same fields).
"""

from __future__ import annotations

import copy
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.cluster.cluster import ClusterAccess
from tests.cluster.fixtures import delete_namespace
from tests.e2e.conftest import eventually
from tests.observe.prometheus import binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ["sandbox-cr", "job"]
Obj = dict[str, Any]


def render(overlay: str) -> list[Obj]:
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(docs: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(deployment: Obj) -> Obj:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


# -- the rendered manifests (no cluster needed) --------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_the_whole_deployment(overlay: str) -> None:
    docs = render(overlay)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted([
        ("Namespace", "leasekeeper"), ("ServiceAccount", "leasekeeper-worker"),
        ("Role", "leasekeeper-worker"), ("RoleBinding", "leasekeeper-worker"),
        ("ConfigMap", "leasekeeper-settings"), ("Secret", "leasekeeper-secrets"),
        ("Job", "leasekeeper-migrate"), ("Deployment", "leasekeeper-worker"),
        ("PodDisruptionBudget", "leasekeeper-worker"), ("Deployment", "leasekeeper-beat"),
        ("Deployment", "leasekeeper-flower"), ("Service", "leasekeeper-flower"),
        ("Deployment", "leasekeeper-metrics"), ("Service", "leasekeeper-metrics"),
        ("Deployment", "leasekeeper-console"), ("Service", "leasekeeper-console")])
    assert {d["metadata"].get("namespace", "leasekeeper") for d in docs} == {"leasekeeper"}
    settings = one(docs, "ConfigMap", "leasekeeper-settings")["data"]
    assert settings["LEASEKEEPER_KUBE_BACKEND"] == overlay
    assert settings["LEASEKEEPER_PROVIDERS"] == "kubernetes"
    assert settings["LEASEKEEPER_KUBE_NAMESPACE"] == "leasekeeper"
    for kind, name in [("Deployment", "leasekeeper-worker"), ("Deployment", "leasekeeper-beat"),
                       ("Deployment", "leasekeeper-flower"), ("Deployment", "leasekeeper-metrics"),
                       ("Deployment", "leasekeeper-console"), ("Job", "leasekeeper-migrate")]:
        pod = one(docs, kind, name)["spec"]["template"]["spec"]
        (main,) = pod["containers"]
        assert main["image"] == "leasekeeper:0.1.0"
        assert main["envFrom"] == [{"configMapRef": {"name": "leasekeeper-settings"}},
                                   {"secretRef": {"name": "leasekeeper-secrets"}}]
        assert main["resources"]["requests"] and main["resources"]["limits"]["memory"]
        # Only the worker talks to the API server: nobody else gets a token.
        assert (pod.get("serviceAccountName") == "leasekeeper-worker") == (
            name == "leasekeeper-worker")
        if name != "leasekeeper-worker":
            assert pod["automountServiceAccountToken"] is False


def test_the_worker_outlives_its_soft_time_limit_and_is_probed_by_ping() -> None:
    docs = render("job")
    settings = one(docs, "ConfigMap", "leasekeeper-settings")["data"]
    worker = one(docs, "Deployment", "leasekeeper-worker")
    pod = worker["spec"]["template"]["spec"]
    assert worker["spec"]["replicas"] >= 2
    assert pod["terminationGracePeriodSeconds"] > float(
        settings["LEASEKEEPER_TASK_SOFT_TIME_LIMIT_S"])
    main = container(worker)
    assert main["command"][-1] == "leasekeeper@%h"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "inspect ping -d leasekeeper@$HOSTNAME" in main[probe]["exec"]["command"][-1]
    pdb = one(docs, "PodDisruptionBudget", "leasekeeper-worker")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        worker["spec"]["template"]["metadata"]["labels"].items())


def test_one_beat_replaced_with_recreate_and_flower_needs_its_secret() -> None:
    docs = render("sandbox-cr")
    beat = one(docs, "Deployment", "leasekeeper-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
    assert "celerybeat-schedule" in container(beat)["livenessProbe"]["exec"]["command"][-1]
    assert one(docs, "Secret", "leasekeeper-secrets")["stringData"]["FLOWER_BASIC_AUTH"] == ""
    script = container(one(docs, "Deployment", "leasekeeper-flower"))["command"][-1]
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "FLOWER_BASIC_AUTH": ""},
                             check=False)
    assert refused.returncode == 2 and "FLOWER_BASIC_AUTH" in refused.stderr


def test_prometheus_scrapes_the_exporters_service_as_the_alerts_expect() -> None:
    docs = render("job")
    metrics = one(docs, "Deployment", "leasekeeper-metrics")
    assert metrics["spec"]["replicas"] == 1  # its counters are its own since its start
    main = container(metrics)
    assert main["command"] == ["leasekeeper", "metrics"]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["LEASEKEEPER_METRICS_HOST"] == "0.0.0.0"
    assert main["readinessProbe"]["httpGet"]["path"] == "/metrics"
    service = one(docs, "Service", "leasekeeper-metrics")
    (port,) = service["spec"]["ports"]
    assert service["spec"]["selector"].items() <= (
        metrics["spec"]["template"]["metadata"]["labels"].items())
    assert int(env["LEASEKEEPER_METRICS_PORT"]) == port["port"] == main["ports"][0][
        "containerPort"]

    # deploy/prometheus/scrape.yml: valid for Prometheus, loads the alert rules, and its
    # job "leasekeeper" (what every alert selects) targets that Service in the namespace
    scrape = DEPLOY / "prometheus" / "scrape.yml"
    done = subprocess.run([binary("promtool"), "check", "config", scrape.name],
                          cwd=scrape.parent, capture_output=True, text=True, check=False,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout
    config = yaml.safe_load(scrape.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "leasekeeper"
    assert 'job="leasekeeper"' in (DEPLOY / "prometheus" / "alerts.yml").read_text()
    assert job["static_configs"] == [{"targets": [
        f"leasekeeper-metrics.leasekeeper.svc:{port['port']}"]}]


def test_the_console_takes_flowers_basic_auth_from_the_secret() -> None:
    docs = render("sandbox-cr")
    console = container(one(docs, "Deployment", "leasekeeper-console"))
    assert console["command"] == ["leasekeeper", "console"]
    (auth,) = [e for e in console["env"] if e["name"] == "LEASEKEEPER_FLOWER_BASIC_AUTH"]
    assert auth["valueFrom"] == {"secretKeyRef": {"name": "leasekeeper-secrets",
                                                  "key": "FLOWER_BASIC_AUTH"}}
    assert "FLOWER_BASIC_AUTH" in one(docs, "Secret", "leasekeeper-secrets")["stringData"]


# -- on the real API server --------------------------------------------------------------

def for_test_cluster(docs: list[Obj], namespace: str, policy_v1: bool, *,
                     broker_url: str = "redis://127.0.0.1:1/0",
                     store_url: str = "postgresql+psycopg://x@127.0.0.1:1/x") -> list[Obj]:
    """The docs for a test cluster's ``namespace``; the Secret's URLs are loopback ones
    (by default where nothing listens)."""
    out = []
    for doc in map(copy.deepcopy, docs):
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            meta["name"] = namespace
        elif "namespace" in meta:
            meta["namespace"] = namespace
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
        if doc["kind"] == "ConfigMap":
            doc["data"]["LEASEKEEPER_KUBE_NAMESPACE"] = namespace
        if doc["kind"] == "Secret":
            doc["stringData"].update(LEASEKEEPER_BROKER_URL=broker_url,
                                     LEASEKEEPER_STORE_URL=store_url)
        if doc["kind"] == "PodDisruptionBudget" and not policy_v1:
            doc["apiVersion"] = "policy/v1beta1"
        out.append(doc)
    return out


def kubectl(cluster: ClusterAccess, docs: list[Obj], *args: str,
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig_path), *args, "-f", "-"],
        input=yaml.safe_dump_all(docs), capture_output=True, text=True,
        check=False, timeout=120)


def _has_policy_v1(api: client.ApiClient) -> bool:
    groups = client.ApisApi(api).get_api_versions().groups
    return any(v.version == "v1" for g in groups if g.name == "policy" for v in g.versions)


@pytest.mark.k8s
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_passes_a_server_dry_run_then_applies(
        overlay: str, kube_cluster: ClusterAccess, kube_api: client.ApiClient) -> None:
    namespace = f"lk-{secrets.token_hex(4)}"
    docs = for_test_cluster(render(overlay), namespace, _has_policy_v1(kube_api))
    ns_doc = [d for d in docs if d["kind"] == "Namespace"]
    rest = [d for d in docs if d["kind"] != "Namespace"]
    try:
        dry = kubectl(kube_cluster, ns_doc, "apply", "--dry-run=server")
        assert dry.returncode == 0 and "(server dry run)" in dry.stdout, dry.stderr
        applied = kubectl(kube_cluster, ns_doc, "apply")
        assert applied.returncode == 0, applied.stderr
        dry = kubectl(kube_cluster, rest, "apply", "--dry-run=server")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.count("(server dry run)") == len(rest), dry.stdout
        apps = client.AppsV1Api(kube_api)
        assert apps.list_namespaced_deployment(namespace).items == []  # nothing created

        # The dry run validates: a broken manifest is refused and names what is wrong.
        broken = copy.deepcopy(one(rest, "Deployment", "leasekeeper-worker"))
        broken["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "long"
        refused = kubectl(kube_cluster, [broken], "apply", "--dry-run=server")
        assert refused.returncode != 0 and "terminationGracePeriodSeconds" in refused.stderr

        applied = kubectl(kube_cluster, rest, "apply")
        assert applied.returncode == 0, applied.stderr
        worker = apps.read_namespaced_deployment("leasekeeper-worker", namespace)
        assert worker.spec.template.spec.termination_grace_period_seconds == 660
        beat = apps.read_namespaced_deployment("leasekeeper-beat", namespace)
        assert beat.spec.strategy.type == "Recreate"
        config = client.CoreV1Api(kube_api).read_namespaced_config_map(
            "leasekeeper-settings", namespace)
        assert config.data["LEASEKEEPER_KUBE_BACKEND"] == overlay

        # The controllers act on them: ReplicaSets create the pods, the Job its pod.
        core = client.CoreV1Api(kube_api)

        def pods(component: str) -> list[Any]:
            return list(core.list_namespaced_pod(
                namespace, label_selector=f"app.kubernetes.io/component={component}").items)

        # (at least: a pod whose container exits here is replaced, and the one it replaces
        # is still listed for a while)
        eventually(lambda: len(pods("worker")) >= 2, 60, "the worker Deployment's 2 pods")
        beat_pods = eventually(lambda: pods("beat"), 60, "beat's pod")
        eventually(lambda: pods("migrate"), 60, "the migration Job's pod")
        assert all(p.spec.automount_service_account_token is False for p in beat_pods)
        assert {p.spec.service_account_name for p in pods("worker")} == {"leasekeeper-worker"}
        # Re-applying the same manifests changes no workload (the Job's template is
        # immutable: a change would be refused). A Secret written as stringData is always
        # re-sent by client-side apply; that is kubectl's, and harmless.
        again = kubectl(kube_cluster, rest, "apply")
        assert again.returncode == 0, again.stderr
        changed = [line for line in again.stdout.splitlines()
                   if not line.endswith(" unchanged") and not line.startswith("secret/")]
        assert changed == [], again.stdout
    finally:
        delete_namespace(kube_api, namespace)
