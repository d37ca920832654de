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
    return manifests["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]


def test_every_manifest_parses_with_kind_and_name(manifests):
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "PersistentVolumeClaim"} <= set(
        manifests
    )
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


def volumes_of(manifests):
    spec = manifests["StatefulSet"]["spec"]["template"]["spec"]
    return {v["name"]: v for v in spec["volumes"]}


def flag_values(args, name):
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def under(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def test_weights_and_secrets_come_from_read_only_volumes(manifests):
    c = container(manifests)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["weights"]["readOnly"] is True
    assert any(
        a.startswith("--auth_tokens_file=" + mounts["tokens"]["mountPath"]) for a in c["args"]
    )
    volumes = volumes_of(manifests)
    assert volumes["tokens"]["secret"]["secretName"]
    assert (
        volumes["weights"]["persistentVolumeClaim"]["claimName"]
        == manifests["PersistentVolumeClaim"]["metadata"]["name"]
    )
    assert volumes["weights"]["persistentVolumeClaim"]["readOnly"] is True
    assert manifests["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_start_up_models_come_from_the_shared_read_only_volume(manifests):
    args = container(manifests)["args"]
    weights = {m["name"]: m for m in container(manifests)["volumeMounts"]}["weights"]
    models = dict(spec.split("=", 1) for spec in flag_values(args, "model"))
    assert set(models) == {"policy", "reference"}
    assert models["policy"] == "/models/base/lm_head.safetensors"
    assert models["reference"] == "/models/reference/lm_head.safetensors"
    for path in models.values():
        assert under(path, weights["mountPath"]), path
    assert flag_values(args, "default_model") == ["policy"]
    assert not flag_values(args, "weights")  # the models are named now


def test_model_root_is_a_writable_per_pod_volume(manifests):
    c = container(manifests)
    root = flag_values(c["args"], "model_root")
    assert len(root) == 1
    mounts = [m for m in c["volumeMounts"] if under(root[0], m["mountPath"])]
    assert len(mounts) == 1 and not mounts[0].get("readOnly", False), mounts
    volume = volumes_of(manifests)[mounts[0]["name"]]
    # emptyDir: each replica keeps its own uploaded versions; never the
    # shared weights claim.
    assert "emptyDir" in volume and volume["emptyDir"]["sizeLimit"]
    assert c["resources"]["requests"]["ephemeral-storage"]
    # The root filesystem stays read-only; only mounted volumes are written.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    spec = manifests["StatefulSet"]["spec"]["template"]["spec"]
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]


def test_versions_and_model_memory_are_bounded(manifests):
    args = container(manifests)["args"]
    assert int(flag_values(args, "max_versions_per_model")[0]) >= 2
    assert int(flag_values(args, "max_model_memory_bytes")[0]) > 0


def test_admin_token_comes_from_its_own_secret(manifests):
    c = container(manifests)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = volumes_of(manifests)
    admin = flag_values(c["args"], "admin_tokens_file")
    assert len(admin) == 1
    mount = [m for m in mounts.values() if under(admin[0], m["mountPath"])]
    assert len(mount) == 1 and mount[0]["readOnly"] is True
    secret = volumes[mount[0]["name"]]["secret"]["secretName"]
    assert secret and secret != volumes["tokens"]["secret"]["secretName"]
    # The scoring tokens are not admin tokens.
    assert admin[0] != flag_values(c["args"], "auth_tokens_file")[0]


def test_readme_explains_replicas_and_live_weights():
    text = (DEPLOY / "README.md").read_text()
    for phrase in (
        "--model_root",
        "emptyDir",
        "read-only",
        "every replica",
        "determinism key",
        "detlogp-admin-tokens",
    ):
        assert phrase in text, phrase


def test_drain_fits_in_the_termination_grace(manifests):
    spec = manifests["StatefulSet"]["spec"]["template"]["spec"]
    grace = next(
        int(a.split("=")[1])
        for a in container(manifests)["args"]
        if a.startswith("--shutdown_grace_s=")
    )
    assert spec["terminationGracePeriodSeconds"] > grace


def test_service_is_headless_and_selects_the_pods(manifests):
    service = manifests["Service"]["spec"]
    labels = manifests["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert service["clusterIP"] == "None"
    assert service["selector"].items() <= labels.items()
    assert {p["port"] for p in service["ports"]} == {50051, 9464}


def test_pdb_keeps_a_replica(manifests):
    pdb = manifests["PodDisruptionBudget"]["spec"]
    labels = manifests["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert pdb["minAvailable"] >= 1
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert manifests["StatefulSet"]["spec"]["replicas"] > pdb["minAvailable"]


def test_dockerfile_keeps_uploaded_versions_in_a_volume():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "--model_root=/var/lib/detlogp/models" in text
    assert 'VOLUME ["/var/lib/detlogp/models"]' in text
    assert "chown detlogp:detlogp /var/lib/detlogp/models" in text


def test_dockerfile_is_multi_stage_on_a_cuda_runtime_base():
    lines = [
        line
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("FROM ")
    ]
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


def test_pod_serves_a_unix_socket_on_a_volume_its_containers_can_share(manifests):
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    server = container(manifests)
    (socket,) = flag_values(server["args"], "unix_socket")
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    folder = socket.rsplit("/", 1)[0]
    # Writable (the root filesystem is read-only) and not a secret or the weights.
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[folder]]
    assert "emptyDir" in volume
    assert not any(m.get("readOnly") for m in server["volumeMounts"] if m["mountPath"] == folder)
    # One pod UID: every container runs as the socket's owner.
    assert pod["securityContext"]["runAsUser"]


def test_systemd_unit_serves_a_unix_socket_in_its_runtime_directory():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((DEPLOY / "systemd" / "detlogp.service").read_text())
    service = unit["Service"]
    args = service["ExecStart"].replace("\\\n", " ").split()
    (socket,) = flag_values(args, "unix_socket")
    # In the directory systemd creates for the service (/run/<RuntimeDirectory>),
    # group members may connect (write permission), others may not.
    assert socket.startswith("/run/" + service["RuntimeDirectory"] + "/")
    assert service["RuntimeDirectoryMode"] == "0750"
    assert service["UMask"] == "0007"


def test_systemd_unit_keeps_uploads_under_var_lib_detlogp():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((DEPLOY / "systemd" / "detlogp.service").read_text())
    service = unit["Service"]
    args = service["ExecStart"].replace("\\\n", " ").split()
    root = flag_values(args, "model_root")
    assert root == ["/var/lib/detlogp/models"]
    # Writable to the service (ProtectSystem=strict makes the rest read-only)...
    assert service["ProtectSystem"] == "strict"
    assert service["StateDirectory"] == "detlogp/models"
    assert root[0] in service["ReadWritePaths"].split()
    # ...while the start-up weights and the tokens are read-only.
    read_only = service["ReadOnlyPaths"].split()
    models = dict(spec.split("=", 1) for spec in flag_values(args, "model"))
    assert set(models) == {"policy", "reference"}
    for path in models.values():
        assert any(under(path, folder) for folder in read_only), path
        assert not under(path, root[0])
    assert not any(under(root[0], folder) for folder in read_only)
    admin = flag_values(args, "admin_tokens_file")
    assert len(admin) == 1 and any(under(admin[0], folder) for folder in read_only)


def test_stateful_set_names_its_pods_through_the_headless_service(manifests):
    spec = manifests["StatefulSet"]["spec"]
    service = manifests["Service"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert spec["podManagementPolicy"] == "Parallel"


def test_every_pod_pulls_from_every_ordinal_before_it_is_ready(manifests):
    spec = manifests["StatefulSet"]["spec"]
    name = manifests["StatefulSet"]["metadata"]["name"]
    service = spec["serviceName"]
    (peers,) = flag_values(container(manifests)["args"], "pull_from")
    assert peers.split(",") == [f"{name}-{i}.{service}:50051" for i in range(spec["replicas"])]
    assert flag_values(container(manifests)["args"], "staged_version_timeout_s")
