"""Every YAML under cluster/ and jobs/ validates against the schema that governs it; the cluster configs
keep their data in a bucket and their runs on a tracking server, with no NFS mount; docker/ pins agree."""

import functools
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import ray
import yaml
from packaging.specifiers import SpecifierSet

from mhf_dist.cli import build_parser
from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.submit import expand_env_vars, load_job_spec, resolved_runtime_env
from mhf_dist.sweep.spec import load_sweep

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO.parent / "shared" / "schemas" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
BUCKET_URI = re.compile(r"^(s3|gs)://[a-z0-9][a-z0-9.-]*[a-z0-9](/\S*)?$")
NEEDS_CRDS = pytest.mark.skipif(
    not KUBERAY.is_dir(), reason="the KubeRay CRD schemas in ../shared/schemas are absent"
)


def _yaml_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.yaml"))


LAUNCHER_CONFIGS = [p for p in _yaml_files("cluster") if "kuberay" not in p.parts]


def _manifests() -> dict[str, dict]:
    """Every KubeRay-folder manifest by kind (a file may hold several documents)."""
    found = {}
    for path in _yaml_files("cluster/kuberay"):
        for manifest in yaml.safe_load_all(path.read_text()):
            found[f"{path.name}:{manifest['kind']}"] = manifest
    return found


def _of_kind(kind: str) -> list[dict]:
    return [manifest for manifest in _manifests().values() if manifest["kind"] == kind]


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=str)
def test_cluster_launcher_configs_pass_rays_schema(path):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] in ("aws", "gcp")
    gpu_types = [name for name in config["available_node_types"] if name.startswith("gpu")]
    assert gpu_types and config["head_node_type"] in config["available_node_types"]


@functools.cache
def _crd_schema(kind: str) -> dict:
    crd = yaml.safe_load((KUBERAY / CRD_FILES[kind]).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _pod_template_schema() -> dict:
    """Kubernetes' PodTemplateSpec, as the RayCluster CRD embeds it for the head's pods."""
    return _crd_schema("RayCluster")["properties"]["spec"]["properties"]["headGroupSpec"]["properties"][
        "template"
    ]


def _service_schema() -> dict:
    """Kubernetes' Service, as the RayCluster CRD embeds it for the head's Service."""
    head = _crd_schema("RayCluster")["properties"]["spec"]["properties"]["headGroupSpec"]
    return head["properties"]["headService"]


def _unknown_keys(value, schema: dict, where: str = "") -> list[str]:
    """Keys the schema does not declare (Kubernetes prunes them silently: a misspelt field is lost)."""
    if isinstance(value, list) and "items" in schema:
        return [key for item in value for key in _unknown_keys(item, schema["items"], f"{where}[]")]
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    found = []
    for key, item in value.items():
        if key in schema["properties"]:
            found += _unknown_keys(item, schema["properties"][key], f"{where}.{key}")
        elif not schema.get("additionalProperties") and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            found.append(f"{where}.{key}")
    return found


def _validate(value, schema: dict) -> None:
    jsonschema.Draft7Validator(schema).validate(value)
    assert _unknown_keys(value, schema) == []


@NEEDS_CRDS
@pytest.mark.parametrize("name", sorted(_manifests()))
def test_kuberay_manifests_validate_against_the_crds(name):
    """Ray's kinds against their CRDs; the tracking server's Deployment and Service against the pod
    template and Service schemas the RayCluster CRD embeds (Kubernetes' own)."""
    manifest = _manifests()[name]
    if manifest["kind"] in CRD_FILES:
        assert manifest["apiVersion"] == "ray.io/v1"
        _validate(manifest, _crd_schema(manifest["kind"]))
    elif manifest["kind"] == "Deployment":
        assert manifest["apiVersion"] == "apps/v1"
        _validate(manifest["spec"]["template"], _pod_template_schema())
        labels = manifest["spec"]["template"]["metadata"]["labels"]
        assert manifest["spec"]["selector"]["matchLabels"].items() <= labels.items()
    else:
        assert (manifest["apiVersion"], manifest["kind"]) == ("v1", "Service")
        _validate(manifest, _service_schema())


@NEEDS_CRDS
def test_the_crd_schema_rejects_a_broken_manifest():
    manifest = yaml.safe_load((REPO / "cluster/kuberay/raycluster.yaml").read_text())
    del manifest["spec"]["headGroupSpec"]["template"]
    with pytest.raises(jsonschema.ValidationError, match="'template' is a required property"):
        jsonschema.Draft7Validator(_crd_schema("RayCluster")).validate(manifest)
    manifest = yaml.safe_load((REPO / "cluster/kuberay/raycluster.yaml").read_text())
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["enviroment"] = head.pop("env")
    assert _unknown_keys(manifest, _crd_schema("RayCluster")) == [
        ".spec.headGroupSpec.template.spec.containers[].enviroment"
    ]


def _pods(manifest: dict) -> list[dict]:
    """The pod specs of a RayCluster (head and worker groups) or a Deployment."""
    if manifest["kind"] == "Deployment":
        return [manifest["spec"]["template"]["spec"]]
    groups = [manifest["spec"]["headGroupSpec"], *manifest["spec"].get("workerGroupSpecs", [])]
    return [group["template"]["spec"] for group in groups]


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def _mlflow_server_args(words: list[str]) -> dict[str, str | None]:
    """`--flag value` / `--flag=value` / `--flag` of an `mlflow server` command line."""
    args: dict[str, str | None] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            following = words[index + 1] if index + 1 < len(words) else "--"
            args[flag] = value or (None if following.startswith("--") else following)
    return args


def _bucket(uri: str) -> str:
    assert BUCKET_URI.match(uri), f"{uri!r} is not a bucket URI"
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.netloc}"


def test_kuberay_keeps_data_in_a_bucket_and_runs_on_the_tracking_server_with_no_shared_volume():
    (cluster,) = _of_kind("RayCluster")
    (deployment,) = _of_kind("Deployment")
    (service,) = _of_kind("Service")
    for pod in [*_pods(cluster), *_pods(deployment)]:  # no NFS, no PersistentVolumeClaim: memory only
        assert all(set(volume) == {"name", "emptyDir"} for volume in pod.get("volumes", [])), pod["volumes"]
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["mlflow", "server"]
    flags = _mlflow_server_args(server["args"])
    assert "--serve-artifacts" in flags and flags["--host"] == "0.0.0.0"
    bucket = _bucket(flags["--artifacts-destination"])
    database = next(item for item in server["env"] if item["name"] == "MLFLOW_BACKEND_STORE_URI")
    assert "secretKeyRef" in database["valueFrom"]  # the password never in a manifest
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in {port["name"] for port in server["ports"]}
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    address = f"{service['metadata']['name']}:{service_port['port']}"
    assert address in flags["--allowed-hosts"].split(",")  # MLflow refuses Host names it was not given
    for pod in _pods(cluster):
        for container in pod["containers"]:
            env = _env(container)
            assert env["MLFLOW_TRACKING_URI"] == f"http://{address}"
            assert _bucket(env["MHF_STORAGE"]) == bucket
    for job in _of_kind("RayJob"):
        env_vars = yaml.safe_load(job["spec"].get("runtimeEnvYAML", "{}")).get("env_vars", {})
        assert "MLFLOW_TRACKING_URI" not in env_vars  # the cluster's server, not another
        args = build_parser().parse_args(job["spec"]["entrypoint"].split()[1:])
        overrides = dict(item.split("=", 1) for item in args.overrides)
        storage = vars(args).get("topology.storage") or args.storage  # train's flag sets the config key
        for uri in (storage, overrides["data.path"], env_vars["MHF_STORAGE"]):
            assert _bucket(uri) == bucket


NODE_COMMANDS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
)


def _ray_start_environment(command: str, tmp_path: Path, env: dict[str, str]) -> str:
    """MLFLOW_TRACKING_URI as the `ray start` of `command` sees it (a stand-in `ray` records it)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "ray-start-env"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(f'#!/bin/sh\necho "$MLFLOW_TRACKING_URI" > {record}\n')
    (bin_dir / "ray").chmod(0o755)
    path = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
    subprocess.run(["bash", "-c", command], env={"PATH": path, **env}, check=True, capture_output=True)
    return record.read_text().strip()


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=str)
def test_launcher_configs_keep_data_in_a_bucket_and_runs_on_the_heads_tracking_server(path, tmp_path):
    """No NFS mount; MHF_STORAGE a bucket; the head runs `mlflow server` (artifacts proxied into the
    same bucket, the database URI only from the mounted env file) before its Ray, and every node's Ray
    starts with MLFLOW_TRACKING_URI at the head's address and the server's port."""
    config = yaml.safe_load(path.read_text())
    commands = [command for key in NODE_COMMANDS for command in config.get(key, [])]
    for command in commands:
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0, command
        assert not re.search(r"\bmount\b|nfs", command, re.IGNORECASE), command
    docker = config["docker"]
    options = [
        *docker.get("run_options", []),
        *docker.get("head_run_options", []),
        *docker.get("worker_run_options", []),
    ]
    assert not [option for option in options if re.match(r"(-v|--volume|--mount)\b", option)]
    env = dict(option.split(" ", 1)[1].split("=", 1) for option in options if option.startswith("--env "))
    bucket = _bucket(env["MHF_STORAGE"])

    head = config["head_start_ray_commands"]
    (server_at,) = [index for index, command in enumerate(head) if "mlflow server" in command]
    (ray_at,) = [index for index, command in enumerate(head) if "ray start --head" in command]
    assert server_at < ray_at
    server = head[server_at]
    flags = _mlflow_server_args(shlex.split(server.split("mlflow server", 1)[1].split(">", 1)[0]))
    assert _bucket(flags["--artifacts-destination"]) == bucket and "--serve-artifacts" in flags
    assert flags["--host"] == "0.0.0.0" and "--backend-store-uri" not in flags
    env_file = next(name for name in config["file_mounts"] if name.endswith("mlflow-server.env"))
    assert f". {env_file}" in server and "MLFLOW_BACKEND_STORE_URI" not in json.dumps(config)

    port = flags["--port"]
    first_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    assert _ray_start_environment(head[ray_at], tmp_path, {}) == f"http://{first_ip}:{port}"
    (worker,) = [command for command in config["worker_start_ray_commands"] if "ray start" in command]
    assert _ray_start_environment(worker, tmp_path, {"RAY_HEAD_IP": "10.1.2.3"}) == f"http://10.1.2.3:{port}"


def test_kuberay_jobs_name_files_and_flags_that_exist():
    """The RayJobs' entrypoints parse as mhf commands and name sweep files shipped in the repo."""
    for manifest in _of_kind("RayJob"):
        words = manifest["spec"]["entrypoint"].split()
        assert words[0] == "mhf"
        args = build_parser().parse_args(words[1:])
        if args.command == "sweep":
            load_sweep(REPO / args.config)


@pytest.mark.parametrize("path", _yaml_files("jobs"), ids=str)
def test_every_yaml_under_jobs_validates(path, monkeypatch):
    """Job specs as Ray job submissions whose entrypoints parse as mhf commands, sweep files as sweeps
    (every trial resolves), the rest as configs."""
    monkeypatch.chdir(REPO)
    if path.name.endswith(".job.yaml"):
        spec = load_job_spec(path)
        runtime_env = resolved_runtime_env(spec, {"MHF_STORAGE": "/shared/mhf"}, REPO)
        assert Path(runtime_env["working_dir"]) == REPO
        assert runtime_env["env_vars"]["MHF_STORAGE"] == "/shared/mhf"
        words = spec.entrypoint.split()
        assert words[0] == "mhf"
        # every flag it passes exists; its paths name the cluster's disk (all taken, as bucket URIs are)
        monkeypatch.setattr("mhf_dist.arguments.is_uri", lambda text: True)
        build_parser().parse_args(words[1:])
    elif path.name.endswith(".sweep.yaml"):
        load_sweep(path)
    else:
        load_config(str(path))


def test_job_spec_mistakes_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.job.yaml"
    bad.write_text("entrypoint: mhf train\nruntime_env: {workdir: .}\n")
    with pytest.raises(ConfigError, match=r"runtime_env: .*unknown runtime_env field\(s\) \['workdir'\]"):
        load_job_spec(bad)
    bad.write_text("entrypoint: mhf train\nresources: {GPU: 1}\n")
    with pytest.raises(ConfigError, match="resources: Extra inputs are not permitted"):
        load_job_spec(bad)
    bad.write_text("runtime_env: {env_vars: {A: 1}}\nentrypoint: x\n")
    with pytest.raises(ConfigError, match="must be of type Dict"):
        load_job_spec(bad)
    bad.write_text("entrypoint: x\nentrypoint_resources: {TPU: .inf}\n")
    with pytest.raises(ConfigError, match=r"entrypoint_resources.TPU: Input should be a finite number"):
        load_job_spec(bad)
    for text, line in (
        ('entrypoint: "  "', r"entrypoint: empty; give the command the job runs"),
        ("entrypoint: x\nentrypoint_num_cpus: true", r"entrypoint_num_cpus: Input should be a valid number"),
        (
            "entrypoint: x\nentrypoint_resources: {custom: -1}",
            r"entrypoint_resources.custom: Input should be gr",
        ),
        (
            "entrypoint: x\nentrypoint_resources: {GPU: 1}",
            r"entrypoint_resources: .*must not contain the key 'CPU' or 'GPU' \(CPUs and GPUs: entrypoint",
        ),
        ("entrypoint: x\nentrypoint_resources: {memory: 1}", r"entrypoint_resources: .*contain the key 'mem"),
        ("entrypoint: x\nruntime_env: {working_dir: ''}", r"runtime_env: empty; give a value"),
        (
            'entrypoint: x\nruntime_env: {env_vars: {A: "${S"}}',
            r"runtime_env: env_vars.A '\$\{S' has an unclosed",
        ),
        (
            "entrypoint: x\nruntime_env: {working_dir: 's3:/b/wd.zip'}",
            r"runtime_env: 's3:/b/wd.zip' is missing a",
        ),
    ):
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: {line}"):
            load_job_spec(bad)
    # a local path is read as every other: `~` and a file: URI are the folder they name, for Ray too
    bad.write_text(f"entrypoint: x\nruntime_env: {{working_dir: '~', py_modules: ['file://{tmp_path}']}}\n")
    assert load_job_spec(bad).runtime_env == {"working_dir": str(Path.home()), "py_modules": [str(tmp_path)]}
    with pytest.raises(ConfigError, match="not found"):
        load_job_spec(tmp_path / "missing.yaml")


def test_env_vars_expand_from_the_submitters_environment():
    env_vars = {"STORE": "${MHF_STORAGE}/x", "URI": "${MLFLOW_TRACKING_URI:-}", "MODE": "${M:-fast}"}
    assert expand_env_vars(env_vars, {"MHF_STORAGE": "/s"}) == {"STORE": "/s/x", "MODE": "fast"}
    with pytest.raises(ConfigError, match=r"needs \$MHF_STORAGE \(it is not set\); export MHF_STORAGE="):
        expand_env_vars(env_vars, {})
    with pytest.raises(ConfigError, match=r"needs \$MHF_STORAGE \(MHF_STORAGE is empty\); export"):
        expand_env_vars(env_vars, {"MHF_STORAGE": ""})


def _pins() -> dict[str, str]:
    lines = (REPO / "requirements" / "cpu.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_docker_images_pin_the_versions_pyproject_and_requirements_pin(dockerfile):
    text = (REPO / "docker" / dockerfile).read_text()
    base = re.search(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-(\w+)$", text, re.MULTILINE)
    assert base, "the image must start FROM a pinned rayproject/ray:<version>-py<XY>-<variant> tag"
    ray_version, python = base.group(1), f"{base.group(2)}.{base.group(3)}"
    assert base.group(4) == ("cpu" if dockerfile.endswith("cpu") else "cu128")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ray_spec = next(dep for dep in project["dependencies"] if dep.startswith("ray["))
    assert ray_version in SpecifierSet(ray_spec.split("]", 1)[1]), (ray_version, ray_spec)
    assert ray_version == ray.__version__, "the image's Ray must be the Ray the tests run on"
    assert project["requires-python"] == f">={python}"
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    assert args["TORCH_VERSION"] == _pins()["torch"]
    assert args["DEEPSPEED_VERSION"] == _pins()["deepspeed"]
