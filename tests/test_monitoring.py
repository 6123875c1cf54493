"""deploy/monitoring: every series the Grafana dashboard and the Prometheus alert rules query exists in a live
scrape of a real coordinator and real sidecars, and the scrapes keep the rules every series follows (no ``job``
label, no -1 for "no value").

A coordinator and two sidecars, each with ``--metrics-bind``; one rank (a Snapshotter in this process, on node A,
its buddy B) restores and snapshots two steps, so that every per-rank, per-job and per-buddy series has a sample.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from snapshotd.client import Snapshotter
from tests.integration.conftest import shm_leftovers
from tests.integration.test_metrics import metered_cluster
from tests.waits import wait_until

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
WAIT = 30.0

SERIES_NAME = re.compile(r"\b(?:snapshotd|process|python)_[A-Za-z0-9_]*")
NOT_NAMES = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
"""Label matchers and label lists in PromQL: a label name there (``snapshotd_job``) is not a series name."""

ONLY_WHEN_BROKEN = {"snapshotd_broken_path"}
"""Series with no sample while all is well: their family must be declared in the scrape all the same."""

DURATION = re.compile(r"^\d+[smhd]$")


def series_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (those of snapshotd, the process and Python)."""
    return set(SERIES_NAME.findall(NOT_NAMES.sub(" ", expr)))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads((MONITORING / "snapshotd.json").read_text())
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


def series_of(fam: Metric) -> set[str]:
    """The series names a family's samples carry: a counter's ``_total``, a histogram's ``_bucket``, ``_sum`` and
    ``_count``, a gauge's own name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
    return {fam.name + s for s in suffixes}


def scrape(port: int) -> list[Metric]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return list(text_string_to_metric_families(reply.read().decode()))


def sample(fams: list[Metric], name: str, **labels: str) -> float | None:
    return next((s.value for f in fams for s in f.samples if s.name == name and s.labels == labels), None)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Metric]]:
    """Both daemons' scrapes (the coordinator's, then each sidecar's families) after a rank snapshotted; the
    daemons are stopped before the module's tests run."""
    tmp_path = tmp_path_factory.mktemp("monitoring")
    tag = os.urandom(4).hex()
    with metered_cluster(str(tmp_path), tag) as (cluster, ports):
        job = cluster.job("monitored")
        state = {"w": torch.zeros(16, 1024), "loop": {"step": 0}}
        snap = Snapshotter(state, job=job, rank=0, world_size=1, sidecar=cluster.ipc("A"), timeout=WAIT)
        try:
            assert snap.restore(timeout=WAIT) == 0
            for step in (
                1,
                2,
            ):  # G grows twice: the coordinator knows the job's step time (its RPO in seconds)
                state["w"] += 1
                state["loop"]["step"] = step
                assert snap.capture(step) and snap.wait(WAIT), snap.stats
                wait_until(
                    lambda s=step: (
                        sample(
                            scrape(ports["coordinator"]), "snapshotd_job_recoverable_step", snapshotd_job=job
                        )
                        == s
                    ),
                    f"the coordinator's G at step {step}",
                    WAIT,
                )
            yield [*scrape(ports["coordinator"]), *scrape(ports["A"]), *scrape(ports["B"])]
        finally:
            snap.close()
    assert not shm_leftovers(tag)


def test_the_alert_rules_are_prometheus_rule_groups() -> None:
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    assert set(doc) == {"groups"} and doc["groups"]
    for group in doc["groups"]:
        assert isinstance(group["name"], str) and group["rules"], group
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), names
    for rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert DURATION.match(rule["for"]), rule
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule
        assert rule["annotations"]["summary"], rule
        assert series_names(rule["expr"]), rule  # it reads snapshotd's series
        assert "$labels.job" not in json.dumps(rule), rule  # the training job is snapshotd_job


def test_every_panel_queries_snapshotd_series_through_its_variables() -> None:
    doc = json.loads((MONITORING / "snapshotd.json").read_text())
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "job"}
    for panel in doc["panels"]:
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"]["uid"] == "${datasource}", panel
        for target in panel["targets"]:
            assert series_names(target["expr"]) and 'job=~"$job"' in target["expr"], target
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


def test_series_names_leave_label_names_out() -> None:
    assert series_names(
        'max by (snapshotd_job) (snapshotd_job_durable_age_seconds{snapshotd_job="a"}) '
        "and on (snapshotd_job) snapshotd_local_rank_alive == 1"
    ) == {"snapshotd_job_durable_age_seconds", "snapshotd_local_rank_alive"}


def test_every_series_the_dashboard_and_the_alerts_query_is_in_a_live_scrape(scraped: list[Metric]) -> None:
    with_samples = {s.name for fam in scraped for s in fam.samples}
    declared = {name for fam in scraped for name in series_of(fam)}
    queried = {
        name
        for expr in [*dashboard_exprs(), *(r["expr"] for r in alert_rules())]
        for name in series_names(expr)
    }
    missing = sorted(n for n in queried - with_samples if not (n in ONLY_WHEN_BROKEN and n in declared))
    assert not missing, f"queried but not scraped: {missing}"
    for name in ("snapshotd_local_rank_durable_age_seconds", "snapshotd_job_durable_age_seconds"):
        assert 0 <= min(s.value for f in scraped for s in f.samples if s.name == name) < WAIT


def test_no_series_carries_a_job_label_or_a_stand_in_for_no_value(scraped: list[Metric]) -> None:
    samples = [s for fam in scraped for s in fam.samples]
    assert not [s for s in samples if "job" in s.labels], "the training job's label is snapshotd_job"
    assert not [s for s in samples if s.value == -1], "a value not known is no sample"
    histograms = {fam.name for fam in scraped if fam.type == "histogram"}
    assert {
        "snapshotd_heartbeat_rtt_seconds",
        "snapshotd_restore_seconds",
        "snapshotd_plan_round_seconds",
    } <= histograms
