"""Issue 46: the container images and Kubernetes manifests in deploy/ stay true to shuttle.

Every manifest validates against the Kubernetes API schema (kubernetes-validate, strict: an unknown field fails); the
KubeRay RayCluster, a custom resource outside that schema, against the fields KubeRay requires, with each of its pod
templates against the Kubernetes schema. Every `shuttle` command line in them parses with shuttle's own parser, probes
reach routes shuttle serves on the port it listens on, the grace period covers the drain, and the Dockerfiles install
shuttle with scripts/install.sh alone.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shuttle.common.process import LAST_WORDS_S
from shuttle.frontend.web.middleware import OPEN_PATHS
from shuttle.launcher.cli import build_parser
from shuttle.launcher.launcher import DRAIN_EXIT_GRACE_S

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILES = sorted(p for p in DEPLOY.glob("Dockerfile*") if p.suffix != ".dockerignore")
KUBERNETES_VERSION = "1.33.0"  # a release every supported cloud still runs

# what KubeRay's RayCluster CRD requires of the fields these manifests use (ray.io/v1)
RAY_CLUSTER = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {"type": "object", "required": ["template"], "additionalProperties": False,
                                  "properties": {"rayStartParams": {"$ref": "#/$defs/params"},
                                                 "template": {"type": "object"},
                                                 "serviceType": {"type": "string"}}},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "template"], "additionalProperties": False,
                    "properties": {"groupName": {"type": "string"}, "replicas": {"type": "integer", "minimum": 0},
                                   "minReplicas": {"type": "integer", "minimum": 0},
                                   "maxReplicas": {"type": "integer", "minimum": 0},
                                   "rayStartParams": {"$ref": "#/$defs/params"},
                                   "template": {"type": "object"}}}},
            },
        },
    },
    "$defs": {"params": {"type": "object", "additionalProperties": {"type": "string"}}},
}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        return [spec["headGroupSpec"]["template"], *(group["template"] for group in spec.get("workerGroupSpecs", []))]
    return []


def shuttle_containers(doc: dict) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every container that runs `shuttle serve` (the image's entrypoint is `shuttle`)."""
    return [(template["spec"], container) for template in pod_templates(doc)
            for container in template["spec"]["containers"] if container.get("args", [None])[0] == "serve"]


def test_the_deploy_folder_has_what_the_docs_name():
    assert [p.name for p in MANIFESTS] == ["deployment.yaml", "raycluster.yaml"]
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schema(path):
    for doc in documents(path):
        if doc["kind"] == "RayCluster":
            jsonschema.validate(doc, RAY_CLUSTER)
            for template in pod_templates(doc):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": template}, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_wrong_field_fails_the_validation():
    """The check is live: a misspelt probe field and a RayCluster without its head both fail."""
    (deployment, _) = documents(DEPLOY / "kubernetes" / "deployment.yaml")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["pathh"] = container["readinessProbe"]["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    (ray_cluster, _) = documents(DEPLOY / "kubernetes" / "raycluster.yaml")
    del ray_cluster["spec"]["headGroupSpec"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ray_cluster, RAY_CLUSTER)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_shuttle_command_lines_parse_and_probes_reach_its_routes(path):
    found = 0
    for doc in documents(path):
        for pod, container in shuttle_containers(doc):
            found += 1
            args = build_parser().parse_args(container["args"])
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["http"] == args.port and args.host == "0.0.0.0"
            for probe in ("startupProbe", "readinessProbe"):
                if probe in container:
                    get = container[probe]["httpGet"]
                    assert get["path"] in OPEN_PATHS and get["port"] in ("http", args.port)
            assert container["livenessProbe"]["tcpSocket"]["port"] in ("http", args.port)
            # preStop, then the drain, the frontend's last answers and the engine's stop fit the grace period
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
            assert pod["terminationGracePeriodSeconds"] >= sleep + args.shutdown_timeout + DRAIN_EXIT_GRACE_S + \
                LAST_WORDS_S  # the frontend's last words at the very end; the engine is killed at once
    assert found == 1


def test_thread_counts_fit_the_cpus_the_pods_get():
    """A container sees every core of its node, so shuttle is told its threads: within the pod's CPU request
    (Deployment: one CPU left to the frontend and scheduler), and a Ray rank's bundle within a worker pod's Ray CPUs."""
    (deployment, _) = documents(DEPLOY / "kubernetes" / "deployment.yaml")
    (_, container), = shuttle_containers(deployment)
    args = build_parser().parse_args(container["args"])
    assert args.worker_threads < float(container["resources"]["requests"]["cpu"])
    (ray_cluster, _) = documents(DEPLOY / "kubernetes" / "raycluster.yaml")
    (_, container), = shuttle_containers(ray_cluster)
    args = build_parser().parse_args(container["args"])
    workers = ray_cluster["spec"]["workerGroupSpecs"]
    assert all(args.worker_threads <= float(group["rayStartParams"]["num-cpus"]) for group in workers)
    assert sum(group["replicas"] for group in workers) >= args.data_parallel_size  # a group per worker pod


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_install_with_the_install_script_and_serve_what_they_expose(path):
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    runs = [rest for op, rest in instructions if op == "RUN"]
    assert "bash scripts/install.sh --serve" in runs  # the one install of shuttle and torch
    assert not any("pip" in run for run in runs), runs  # no install step of its own beside the script's
    # KubeRay runs `ray` in a login shell, whose /etc/profile resets PATH: the venv's commands are linked onto it
    assert any("ln -s" in run and "/.venv/bin/ray" in run and "/usr/local/bin" in run for run in runs), runs
    assert any("wget" in run for run in runs), runs  # KubeRay's probes of a Ray container run it
    entrypoint = [rest for op, rest in instructions if op == "ENTRYPOINT"]
    cmd = [rest for op, rest in instructions if op == "CMD"]
    assert entrypoint == ['["shuttle"]']
    args = build_parser().parse_args(yaml.safe_load(cmd[0]))
    assert [rest for op, rest in instructions if op == "EXPOSE"] == [str(args.port)]
    assert args.host == "0.0.0.0"


def test_the_install_scripts_serve_extras_exist():
    script = (DEPLOY.parent / "scripts" / "install.sh").read_text()
    serve_extras = re.search(r"serve=true extras='([^']+)'", script).group(1).split(",")
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    assert all(re.search(rf"^{extra} = \[", pyproject, re.M) for extra in serve_extras), serve_extras
    assert shlex.split("bash scripts/install.sh --serve")[-1] == "--serve"
