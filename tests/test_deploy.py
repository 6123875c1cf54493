"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (a PyTorchJob against the Kubeflow
training operator's models, its pod template against Kubernetes'), and every snapshotd command and setting in the
manifests, the systemd units and the Dockerfile is one that snapshotd takes."""

from __future__ import annotations

import configparser
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubeflow.training import models as kubeflow_models

from snapshotd.cli import _parser
from snapshotd.flags import env_name

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES_VERSION = "1.30"  # native sidecar containers are beta, on by default, from 1.29
CLIENT_ENV = {"SNAPSHOTD_SECRET", "SNAPSHOTD_JOB", "SNAPSHOTD_SIDECAR", "SNAPSHOTD_STORE"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [
            (f"{path.name}:{d['kind']}/{d['metadata']['name']}", d)
            for d in yaml.safe_load_all(path.read_text())
        ]
    return docs


def _pods(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of ``doc``'s pod templates (a PyTorchJob's: one per replica type)."""
    spec = doc.get("spec", {})
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    return [spec["template"]["spec"]] if "template" in spec else []


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for pod in _pods(doc) for c in (*pod.get("initContainers", []), *pod.get("containers", []))]


def _validate(doc: dict[str, Any]) -> None:
    """``doc`` against the Kubernetes schemas, or a ``kubeflow.org/v1`` kind against the training operator's models.

    Raises:
        kubernetes_validate.ValidationError, ValueError: naming the field.
    """
    if doc.get("apiVersion") != "kubeflow.org/v1":
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    _check_model(body, f"KubeflowOrgV1{doc['kind']}", doc["kind"])


def _check_model(value: Any, kind: str, where: str) -> None:
    """``value`` is of the Kubeflow model type named ``kind`` (the models' own type names): no field the model lacks,
    scalars of the right type, pod templates valid Kubernetes."""
    if kind.startswith("list["):
        assert isinstance(value, list), f"{where}: a list expected"
        for i, item in enumerate(value):
            _check_model(item, kind[5:-1], f"{where}[{i}]")
    elif kind.startswith("dict(str, "):
        assert isinstance(value, dict), f"{where}: a mapping expected"
        for key, item in value.items():
            _check_model(item, kind[10:-1], f"{where}.{key}")
    elif kind in ("str", "int", "bool"):
        assert type(value).__name__ == kind, f"{where}: {value!r} is no {kind}"
    elif kind == "V1PodTemplateSpec":
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": value}
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)
    else:
        model = getattr(kubeflow_models, kind)
        fields = {name: attr for attr, name in model.attribute_map.items()}
        assert isinstance(value, dict), f"{where}: a mapping expected"
        for key, item in value.items():
            assert key in fields, f"{where}: {key!r} is no field of {kind} ({sorted(fields)})"
            _check_model(item, model.openapi_types[fields[key]], f"{where}.{key}")


def _flags_of(command: str) -> set[str]:
    """The environment variables of ``snapshotd <command>``'s long flags."""
    sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    return {env_name(o) for a in sub._actions for o in a.option_strings if o.startswith("--")}


def _check_command(argv: list[str], env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``argv`` (``snapshotd ...``) with the ``SNAPSHOTD_*`` settings ``env`` is a command snapshotd takes."""
    assert argv[0] in ("snapshotd", "/usr/local/bin/snapshotd"), where
    unknown = {k for k in env if k.startswith("SNAPSHOTD_")} - _flags_of(argv[1]) - CLIENT_ENV
    assert not unknown, f"{where}: settings no flag of `snapshotd {argv[1]}` takes: {sorted(unknown)}"
    for name in [k for k in os.environ if k.startswith("SNAPSHOTD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _parser().parse_args(argv[1:])
    assert args.command == argv[1], where


def test_the_manifests_validate_against_the_kubernetes_schemas() -> None:
    docs = _documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "Job", "PyTorchJob", "PriorityClass"}
    for where, doc in docs:
        try:
            _validate(doc)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spec.elasticPolicy.minReplica", 4),
        ("spec.elasticPolicy.minReplicas", "4"),
        ("spec.runPolicy.ttl", 1),
    ],
)
def test_a_pytorchjob_with_a_field_misspelt_or_mistyped_is_refused(field: str, value: Any) -> None:
    (job,) = [d for _, d in _documents() if d["kind"] == "PyTorchJob"]
    node = job
    *parents, last = field.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    with pytest.raises(AssertionError, match=last):
        _validate(job)


def test_every_snapshotd_container_runs_a_command_snapshotd_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for where, doc in _documents():
        for c in _containers(doc):
            argv = [*c.get("command", []), *c.get("args", [])]
            if argv[:1] != ["snapshotd"]:
                continue
            if argv[1:] == ["--version"]:  # a spare's image pull
                with pytest.raises(SystemExit) as exited:
                    _parser().parse_args(argv[1:])
                assert exited.value.code == 0
                continue
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            _check_command(argv, env, f"{where} container {c['name']}", monkeypatch)
            seen.add(argv[1])
    assert seen == {"coordinator", "rdzv-store", "serve"}


@pytest.mark.parametrize(("kind", "node_name"), [("Job", "JOB_COMPLETION_INDEX"), ("PyTorchJob", "POD_NAME")])
def test_the_trainer_and_its_sidecar_share_the_ipc_socket_and_shared_memory(
    kind: str, node_name: str
) -> None:
    (job,) = [d for _, d in _documents() if d["kind"] == kind]
    (pod,) = _pods(job)
    (sidecar,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before the trainer, down after it
    env = {c["name"]: {e["name"]: e.get("value") for e in c["env"]} for c in (sidecar, trainer)}
    env["trainer"] = env.pop(trainer["name"])
    assert env["trainer"]["SNAPSHOTD_SIDECAR"] == env["snapshotd-sidecar"]["SNAPSHOTD_IPC"]
    assert node_name in env["snapshotd-sidecar"]["SNAPSHOTD_NODE"]  # the same after the pod's recreation
    assert env["trainer"]["SNAPSHOTD_JOB"] == "$(JOB_NAME)"  # never torchrun's default rdzv id, "none"
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, trainer)]
    assert mounts[0] == mounts[1] and mounts[0]["/dev/shm"] == "shm"
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    (control,) = [
        d for _, d in _documents() if d["kind"] == "Service" and d["metadata"]["name"] == "snapshotd-control"
    ]
    ports = {p["port"] for p in control["spec"]["ports"]}
    host = "snapshotd-control"
    assert env["snapshotd-sidecar"]["SNAPSHOTD_COORDINATOR"] == f"tcp://{host}:7070" and 7070 in ports
    argv = [*trainer["command"], *trainer.get("args", [])]
    # live mode's store (SNAPSHOTD_STORE), or torchrun's c10d rendezvous on it with every agent a client
    store = env["trainer"].get("SNAPSHOTD_STORE") or argv[argv.index("--rdzv-endpoint") + 1]
    assert store == f"{host}:29400" and 29400 in ports
    if "--rdzv-conf" in argv:
        assert "is_host=false" in argv[argv.index("--rdzv-conf") + 1]
        assert env["trainer"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize("unit", sorted(p.name for p in (DEPLOY / "systemd").glob("*.service")))
def test_each_systemd_unit_starts_a_command_snapshotd_takes(
    unit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.read_string((DEPLOY / "systemd" / unit).read_text())
    argv = ini["Service"]["ExecStart"].split()
    # the settings the unit's comment shows for its environment file
    text = (DEPLOY / "systemd" / unit).read_text()
    env = dict(re.findall(r"#\s+(SNAPSHOTD_[A-Z_]+)=(\S+)", text))
    env = {k: ("x" if v == "..." else v) for k, v in env.items() if k != "SNAPSHOTD_SECRET_FILE"}
    _check_command(argv, env, unit, monkeypatch)
    assert ini["Service"]["EnvironmentFile"].startswith("/etc/snapshotd/")


def test_the_dockerfile_copies_what_the_package_needs() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    copied = {p for line in re.findall(r"^COPY (.+) /src/", text, re.M) for p in line.split()}
    for path in copied:
        assert (DEPLOY.parent / path).exists(), f"the Dockerfile copies {path}, which the repository lacks"
    import tomllib

    package_dirs = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    assert {d.split("/")[0] for d in package_dirs.values()} <= copied
    assert 'ENTRYPOINT ["snapshotd"]' in text
