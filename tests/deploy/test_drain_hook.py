"""The Kubernetes drain hook (deploy/kubernetes/drain_node.py), run as the agent runs it: a
process with the event in its environment, talking HTTPS to an API server with a bearer token.

The API server is a fake (tests/deploy/_fake_kubernetes.py): no cluster runs on this machine.
It records every call as the RBAC verb and resource it needs, so the tests also check that the
hook uses exactly what its ClusterRole (deploy/kubernetes/agent.yaml) grants, nothing more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ._fake_kubernetes import TOKEN, FakeKubernetes, pod, serve
from ._paths import KUBERNETES

HOOK = KUBERNETES / "drain_node.py"
ANNOTATION = "scheduledeventsrelay.github.io/cordoned-for"
NODE = "aks-pool1-12345678-vmss000000"


@pytest.fixture
def api() -> FakeKubernetes:
    fake = FakeKubernetes()
    fake.add_node(NODE)
    fake.add_node("aks-pool1-12345678-vmss000001")
    return fake


@pytest.fixture
def cluster(api: FakeKubernetes, tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    with serve(api, tmp_path) as (url, ca_file):
        yield url, ca_file, token


def run_hook(
    cluster: tuple[str, Path, Path],
    transition: str,
    event_type: str = "Reboot",
    event_id: str = "E1",
    *extra: str,
    token: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    url, ca_file, token_file = cluster
    env = {
        "PATH": os.environ.get("PATH", ""),
        "NODE_NAME": NODE,
        "TRANSITION": transition,
        "EVENT_TYPE": event_type,
        "EVENT_ID": event_id,
    }
    return subprocess.run(
        [
            sys.executable,
            str(HOOK),
            "--api-server",
            url,
            "--ca-file",
            str(ca_file),
            "--token-file",
            str(token or token_file),
            "--retry-interval",
            "0.05",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def granted_rules() -> set[tuple[str, str]]:
    documents = list(yaml.safe_load_all((KUBERNETES / "agent.yaml").read_text()))
    role = next(d for d in documents if d["kind"] == "ClusterRole")
    return {
        (verb, resource)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def annotation(api: FakeKubernetes, node: str = NODE) -> str | None:
    annotations: dict[str, str] = api.node(node)["metadata"].get("annotations", {})
    return annotations.get(ANNOTATION)


def test_reboot_cordons_evicts_and_waits_then_completion_uncordons(api, cluster):
    api.pods = [
        pod("web-1", NODE),
        pod("db-0", NODE, namespace="data", owner="StatefulSet"),
        pod("agent-x", NODE, owner="DaemonSet"),
        pod("kube-proxy-static", NODE, owner="Node", mirror=True),
        pod("job-done", NODE, owner="Job", phase="Succeeded"),
        pod("web-2", "aks-pool1-12345678-vmss000001"),
    ]
    api.budgets = {"data/db-0": 2}  # its PodDisruptionBudget says "not now" twice
    api.conflicts = 1  # someone else changed the node between our read and our patch

    result = run_hook(cluster, "scheduled")

    assert result.returncode == 0, result.stderr
    assert api.node(NODE)["spec"]["unschedulable"] is True
    assert annotation(api) == "E1"
    assert sorted(api.evicted) == ["data/db-0", "default/web-1"]
    left = {p["metadata"]["name"] for p in api.pods}
    assert left == {"agent-x", "kube-proxy-static", "job-done", "web-2"}
    assert "disruption budget" in result.stderr
    assert "node aks-pool1-12345678-vmss000000 is drained (2 pod(s) evicted)" in result.stderr

    result = run_hook(cluster, "completed")

    assert result.returncode == 0, result.stderr
    assert "unschedulable" not in api.node(NODE)["spec"]
    assert annotation(api) is None
    # The other node was never touched.
    assert "unschedulable" not in api.node("aks-pool1-12345678-vmss000001")["spec"]
    # What it used is exactly what its ClusterRole grants.
    assert set(api.calls) == granted_rules()


def test_started_without_scheduled_drains_too(api, cluster):
    """Hardware failure: the event is first seen Started."""
    api.pods = [pod("web-1", NODE)]
    assert run_hook(cluster, "started", "Redeploy").returncode == 0
    assert api.evicted == ["default/web-1"]


def test_a_freeze_drains_nothing(api, cluster):
    api.pods = [pod("web-1", NODE)]
    result = run_hook(cluster, "scheduled", "Freeze")
    assert result.returncode == 0, result.stderr
    assert api.calls == []
    assert "not one of" in result.stderr


def test_stays_cordoned_until_the_last_of_its_events_is_over(api, cluster):
    assert run_hook(cluster, "scheduled", "Reboot", "E1").returncode == 0
    assert run_hook(cluster, "scheduled", "Redeploy", "E2").returncode == 0
    assert annotation(api) == "E1,E2"

    assert run_hook(cluster, "canceled", "Redeploy", "E2").returncode == 0
    assert api.node(NODE)["spec"]["unschedulable"] is True
    assert annotation(api) == "E1"

    assert run_hook(cluster, "completed", "Reboot", "E1").returncode == 0
    assert "unschedulable" not in api.node(NODE)["spec"]


def test_never_uncordons_a_node_someone_else_cordoned(api, cluster):
    api.add_node(NODE, unschedulable=True)  # an operator's cordon
    api.pods = [pod("web-1", NODE)]
    assert run_hook(cluster, "scheduled").returncode == 0
    assert api.evicted == ["default/web-1"]
    assert annotation(api) is None
    assert run_hook(cluster, "completed").returncode == 0
    assert api.node(NODE)["spec"]["unschedulable"] is True


def test_fails_when_the_node_cannot_be_emptied_in_time(api, cluster):
    api.pods = [pod("db-0", NODE, namespace="data", owner="StatefulSet")]
    api.budgets = {"data/db-0": 10**6}
    result = run_hook(cluster, "scheduled", "Reboot", "E1", "--timeout", "0.5")
    assert result.returncode == 1
    assert "not drained after 0.5 s: ['data/db-0']" in result.stderr


def test_a_wrong_token_is_refused_and_reported(api, cluster, tmp_path):
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token")
    result = run_hook(cluster, "scheduled", token=wrong)
    assert result.returncode == 1
    assert "401 Unauthorized" in result.stderr
    assert api.calls == []


def test_without_a_node_name_it_is_a_usage_error(cluster):
    url, _, token = cluster
    result = subprocess.run(
        [sys.executable, str(HOOK), "--api-server", url, "--token-file", str(token)],
        env={"TRANSITION": "scheduled", "EVENT_TYPE": "Reboot", "EVENT_ID": "E1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "needs the node" in result.stderr
