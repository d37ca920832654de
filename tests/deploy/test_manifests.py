"""Parses every deployment file and checks the fields that matter."""
import configparser
import pathlib

import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def load_all():
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


@pytest.fixture(scope="module")
def manifests():
    return load_all()


def container(manifests):
    return manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_every_manifest_parses_with_kind_and_name(manifests):
    assert {"Deployment", "Service", "PodDisruptionBudget",
            "PersistentVolumeClaim"} <= set(manifests)
    for doc in manifests.values():
        assert doc["metadata"]["name"]


def test_deployment_requests_a_gpu_with_limits(manifests):
    resources = container(manifests)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    for key in ("cpu", "memory"):
        assert key in resources["requests"] and key in resources["limits"]


def test_probes_use_grpc_health_on_the_serving_port(manifests):
    c = container(manifests)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"], probe
    args = c["args"]
    assert "--port=50051" in args and "--metrics_port=9464" in args
    assert "--host=0.0.0.0" in args  # pods must listen beyond loopback


def test_weights_and_secrets_come_from_read_only_volumes(manifests):
    c = container(manifests)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["weights"]["readOnly"] is True
    assert any(a.startswith("--weights=" + mounts["weights"]["mountPath"]) for a in c["args"])
    assert any(a.startswith("--auth_tokens_file=" + mounts["tokens"]["mountPath"]) for a in c["args"])
    volumes = {v["name"]: v for v in manifests["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokens"]["secret"]["secretName"]
    assert volumes["weights"]["persistentVolumeClaim"]["claimName"] == \
        manifests["PersistentVolumeClaim"]["metadata"]["name"]


def test_drain_fits_in_the_termination_grace(manifests):
    spec = manifests["Deployment"]["spec"]["template"]["spec"]
    grace = next(int(a.split("=")[1]) for a in container(manifests)["args"]
                 if a.startswith("--shutdown_grace_s="))
    assert spec["terminationGracePeriodSeconds"] > grace


def test_service_is_headless_and_selects_the_pods(manifests):
    service = manifests["Service"]["spec"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["clusterIP"] == "None"
    assert service["selector"].items() <= labels.items()
    assert {p["port"] for p in service["ports"]} == {50051, 9464}


def test_pdb_keeps_a_replica(manifests):
    pdb = manifests["PodDisruptionBudget"]["spec"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pdb["minAvailable"] >= 1
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert manifests["Deployment"]["spec"]["replicas"] > pdb["minAvailable"]


def test_dockerfile_is_multi_stage_on_a_cuda_runtime_base():
    lines = [l for l in (DEPLOY / "Dockerfile").read_text().splitlines()
             if l.startswith("FROM ")]
    assert len(lines) == 2
    assert "devel" in lines[0] and " AS build" in lines[0]
    assert "runtime" in lines[1]
    text = (DEPLOY / "Dockerfile").read_text()
    assert "bazel build //server:detlogp_server" in text
    assert "STOPSIGNAL SIGTERM" in text and "USER 10001" in text


def test_systemd_unit_drains_on_sigterm():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((DEPLOY / "systemd" / "detlogp.service").read_text())
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM"
    grace = int(service["ExecStart"].split("--shutdown_grace_s=")[1].split()[0])
    assert int(service["TimeoutStopSec"]) > grace
    assert service["Restart"] == "on-failure"
    assert "--host=127.0.0.1" in service["ExecStart"]
