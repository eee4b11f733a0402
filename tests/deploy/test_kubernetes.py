"""The Kubernetes manifests, validated offline against a pinned Kubernetes version with the
``kubernetes-validate`` package (strict: an unknown field fails), and checked for what the
deployment needs: the agent on every node with the node's network and a state on the node,
the drain hook with its least RBAC, two approvers and an audit, probes on /healthz and
Prometheus scrape annotations everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ._paths import KUBERNETES

#: The Kubernetes version the manifests are validated against (AKS supports it; the
#: ValidatingAdmissionPolicy API is GA since 1.30).
KUBERNETES_VERSION = "1.32.0"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))


def _documents() -> list[dict[str, Any]]:
    return [
        document
        for manifest in MANIFESTS
        for document in yaml.safe_load_all(manifest.read_text())
        if document
    ]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda path: path.name)
def test_manifest_validates_against_the_pinned_kubernetes_version(manifest: Path):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (it is in the dev extra)"
    )
    documents = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    """The validator really validates (a typo in a field name fails, strict)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    daemonset = _one("DaemonSet", "scheduled-events-agent")
    daemonset["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def _probes_on_healthz(container: dict[str, Any]) -> None:
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz", probe


def _scraped(workload: dict[str, Any], port: int) -> None:
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def _hardened(pod: dict[str, Any], container: dict[str, Any]) -> None:
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "add" not in context["capabilities"]


def test_the_agent_daemonset_runs_on_every_node_with_the_node_network():
    daemonset = _one("DaemonSet", "scheduled-events-agent")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True  # IMDS is link-local
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"operator": "Exists"} in pod["tolerations"]  # every taint, every node
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == "/var/lib/scheduled-events-agent"
    agent = _container(daemonset, "agent")
    assert "--state-dir=/var/lib/scheduled-events-agent" in agent["args"]
    assert any(m["name"] == "state" for m in agent["volumeMounts"])
    _probes_on_healthz(agent)
    _scraped(daemonset, 9464)
    _hardened(pod, agent)
    # The secret is a file, never an environment variable.
    assert "--broker-file=/etc/scheduled-events/broker/broker" in agent["args"]
    assert not any("BROKER" in e["name"] for e in agent.get("env", []))
    # It drains on SIGTERM within the grace period.
    assert pod["terminationGracePeriodSeconds"] >= 20


def test_the_drain_hook_is_wired_with_its_node_and_time():
    daemonset = _one("DaemonSet", "scheduled-events-agent")
    agent = _container(daemonset, "agent")
    hooks = [a for a in agent["args"] if a.startswith("--hook=")]
    assert hooks == [
        "--hook=scheduled,started,completed,canceled=scheduled-events-drain-node --timeout 270"
    ]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The agent kills a hook after its timeout: longer than the drain's own deadline.
    assert int(env["SCHEDULED_EVENTS_HOOK_TIMEOUT"]["value"]) > 270
    # The image ships the hook under that name.
    containerfile = (KUBERNETES.parent / "container" / "Containerfile").read_text()
    assert "/opt/scheduled-events-relay/bin/scheduled-events-drain-node" in containerfile


def test_the_agent_rbac_is_the_least_the_drain_needs():
    role = _one("ClusterRole", "scheduled-events-agent-drain")
    granted = {
        (tuple(rule["apiGroups"]), resource, tuple(sorted(rule["verbs"])))
        for rule in role["rules"]
        for resource in rule["resources"]
    }
    assert granted == {
        (("",), "nodes", ("get", "patch")),
        (("",), "pods", ("list",)),
        (("",), "pods/eviction", ("create",)),
    }
    binding = _one("ClusterRoleBinding", "scheduled-events-agent-drain")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": "scheduled-events-agent",
            "namespace": "scheduled-events-agent",
        }
    ]
    daemonset = _one("DaemonSet", "scheduled-events-agent")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "scheduled-events-agent"
    policy = _one("ValidatingAdmissionPolicy", "scheduled-events-agent-own-node")
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert "system:serviceaccount:scheduled-events-agent:scheduled-events-agent" in condition


def test_two_approvers_one_audit_with_probes_and_no_api_token():
    approver = _one("Deployment", "scheduled-events-approver")
    audit = _one("Deployment", "scheduled-events-audit")
    assert approver["spec"]["replicas"] == 2
    assert audit["spec"]["replicas"] == 1
    for workload, name in ((approver, "approver"), (audit, "audit")):
        pod = workload["spec"]["template"]["spec"]
        container = _container(workload, name)
        _probes_on_healthz(container)
        _scraped(workload, 8080)
        _hardened(pod, container)
        assert pod["automountServiceAccountToken"] is False
        assert container["args"][0] == name
        assert "--health-port=8080" in container["args"]
        assert "--broker-file=/etc/scheduled-events/secrets/broker" in container["args"]
        assert "--db-file=/etc/scheduled-events/secrets/db" in container["args"]
    approver_args = _container(approver, "approver")["args"]
    assert "--signing-key=/etc/scheduled-events/secrets/approver.key" in approver_args
    budget = _one("PodDisruptionBudget", "scheduled-events-approver")
    assert budget["spec"]["minAvailable"] == 1


def test_every_workload_runs_the_one_image():
    images = {
        container["image"]
        for document in _documents()
        if document["kind"] in ("DaemonSet", "Deployment")
        for key in ("containers", "initContainers")
        for container in document["spec"]["template"]["spec"].get(key, [])
    }
    assert len(images) == 1, images
