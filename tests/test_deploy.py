"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas, and every snapshotd command and
setting in the manifests, the systemd units and the Dockerfile is one that snapshotd takes."""

from __future__ import annotations

import configparser
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

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


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


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
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "Job"}
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}")


def test_every_snapshotd_container_runs_a_command_snapshotd_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for where, doc in _documents():
        for c in _containers(doc):
            argv = [*c.get("command", []), *c.get("args", [])]
            if argv[:1] != ["snapshotd"]:
                continue
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            _check_command(argv, env, f"{where} container {c['name']}", monkeypatch)
            seen.add(argv[1])
    assert seen == {"coordinator", "rdzv-store", "serve"}


def test_the_trainer_and_its_sidecar_share_the_ipc_socket_and_shared_memory() -> None:
    (job,) = [d for _, d in _documents() if d["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before the trainer, down after it
    env = {c["name"]: {e["name"]: e.get("value") for e in c["env"]} for c in (sidecar, trainer)}
    assert env["trainer"]["SNAPSHOTD_SIDECAR"] == env["snapshotd-sidecar"]["SNAPSHOTD_IPC"]
    assert "JOB_COMPLETION_INDEX" in env["snapshotd-sidecar"]["SNAPSHOTD_NODE"]  # the same after a recreation
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
    assert env["trainer"]["SNAPSHOTD_STORE"] == f"{host}:29400" and 29400 in ports


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
