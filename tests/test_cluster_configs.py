"""Every YAML under cluster/ and jobs/ validates against the schema that governs it; docker/ pins agree."""

import functools
import json
import re
import tomllib
from pathlib import Path

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


def _yaml_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in _yaml_files("cluster") if "kuberay" not in p.parts], ids=str)
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


@pytest.mark.skipif(not KUBERAY.is_dir(), reason="the KubeRay CRD schemas in ../shared/schemas are absent")
@pytest.mark.parametrize("path", _yaml_files("cluster/kuberay"), ids=str)
def test_kuberay_manifests_validate_against_the_crds(path):
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(_crd_schema(manifest["kind"])).validate(manifest)


@pytest.mark.skipif(not KUBERAY.is_dir(), reason="the KubeRay CRD schemas in ../shared/schemas are absent")
def test_the_crd_schema_rejects_a_broken_manifest():
    manifest = yaml.safe_load((REPO / "cluster/kuberay/raycluster.yaml").read_text())
    del manifest["spec"]["headGroupSpec"]["template"]
    with pytest.raises(jsonschema.ValidationError, match="'template' is a required property"):
        jsonschema.Draft7Validator(_crd_schema("RayCluster")).validate(manifest)


def test_kuberay_jobs_name_files_and_flags_that_exist():
    """The RayJobs' entrypoints parse as mhf commands and name sweep files shipped in the repo."""
    for path in _yaml_files("cluster/kuberay"):
        manifest = yaml.safe_load(path.read_text())
        if manifest["kind"] != "RayJob":
            continue
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
        build_parser().parse_args(words[1:])  # every flag it passes exists
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
    with pytest.raises(ConfigError, match="not found"):
        load_job_spec(tmp_path / "missing.yaml")


def test_env_vars_expand_from_the_submitters_environment():
    env_vars = {"STORE": "${MHF_STORAGE}/x", "URI": "${MLFLOW_TRACKING_URI:-}", "MODE": "${M:-fast}"}
    assert expand_env_vars(env_vars, {"MHF_STORAGE": "/s"}) == {"STORE": "/s/x", "MODE": "fast"}
    with pytest.raises(ConfigError, match=r"needs \$MHF_STORAGE; export MHF_STORAGE=\.\.\. or pass --env"):
        expand_env_vars(env_vars, {})


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
