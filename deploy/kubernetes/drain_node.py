#!/usr/bin/env python3
"""Cordon and drain this Kubernetes node before Azure maintenance; uncordon it afterwards.

The agent's hook on AKS nodes (``--hook scheduled,started,completed,canceled=
scheduled-events-drain-node``). The agent passes the event in the environment; this script:

- ``TRANSITION`` scheduled or started, ``EVENT_TYPE`` one of ``--drain-types`` (default
  Reboot, Redeploy, Preempt, Terminate: a Freeze pauses the VM for seconds and keeps memory):
  marks the node unschedulable, evicts its pods through the Eviction API (so PodDisruptionBudgets
  are honoured; an eviction refused with 429 is tried again), and waits until they are gone;
- ``TRANSITION`` completed or canceled: makes the node schedulable again, but only once no event
  that this script cordoned it for is still pending, and never when someone else cordoned it.

The events it cordoned the node for are kept in the node's annotation
``scheduledeventsrelay.github.io/cordoned-for`` (comma-separated event ids), updated with the
node's resourceVersion so two concurrent runs cannot lose one another's change.

It uses only what its ClusterRole grants: get and patch nodes, list pods, create pods/eviction.
DaemonSet pods, mirror (static) pods and finished pods are left where they are, like
``kubectl drain --ignore-daemonsets``.

In a pod it signs in with the pod's ServiceAccount token and trusts the cluster's CA; the node
is ``--node`` or ``NODE_NAME`` (the downward API's ``spec.nodeName``). Python's standard library
only: it runs in the agent's image and on any node.

Exit status: 0 done (or nothing to do), 1 pods still on the node at the deadline or the API
refused, 2 bad usage. The agent reports it as ``hook.completed``; an approver policy that waits
for hooks approves nothing on a failure, so the event then starts at its NotBefore.

    NODE_NAME=aks-pool-1 TRANSITION=scheduled EVENT_TYPE=Reboot EVENT_ID=E1 \\
        scheduled-events-drain-node --timeout 270
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

ANNOTATION = "scheduledeventsrelay.github.io/cordoned-for"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DRAIN_TYPES = ("Reboot", "Redeploy", "Preempt", "Terminate")
DRAIN_ON = frozenset({"scheduled", "started"})
UNCORDON_ON = frozenset({"completed", "canceled"})
_MIRROR = "kubernetes.io/config.mirror"
_REQUEST_TIMEOUT = 10.0
_CONFLICT_TRIES = 5

JsonObject = dict[str, Any]


class DrainError(Exception):
    """The API refused, or the node could not be emptied in time."""


def log(message: str) -> None:
    print(f"scheduled-events-drain-node: {message}", file=sys.stderr, flush=True)


class KubernetesApi:
    """The few calls this script makes, over HTTPS with a bearer token."""

    def __init__(self, server: str, token: str, ca_file: str | None) -> None:
        self.server = server.rstrip("/")
        self._token = token
        if server.startswith("https://"):
            self._context: ssl.SSLContext | None = ssl.create_default_context(cafile=ca_file)
        else:
            self._context = None

    def request(
        self,
        method: str,
        path: str,
        body: JsonObject | None = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, JsonObject]:
        """The status and the JSON answer; an HTTP error status is returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(
                request, timeout=_REQUEST_TIMEOUT, context=self._context
            ) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            raise DrainError(f"{method} {path}: the API server is unreachable: {exc}") from exc
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"message": raw[:200].decode(errors="replace")}
        return status, answer if isinstance(answer, dict) else {}

    def checked(self, method: str, path: str, **kwargs: Any) -> JsonObject:
        status, answer = self.request(method, path, **kwargs)
        if status >= 300:
            raise DrainError(f"{method} {path}: {status} {answer.get('message', '')}".rstrip())
        return answer


def _node_path(node: str) -> str:
    return f"/api/v1/nodes/{urllib.parse.quote(node, safe='')}"


def _cordoned_for(node: JsonObject) -> list[str]:
    annotations = node.get("metadata", {}).get("annotations") or {}
    value = annotations.get(ANNOTATION, "")
    return [event for event in value.split(",") if event]


def _patch_node(api: KubernetesApi, node_name: str, change: Any) -> None:
    """Apply ``change(node) -> patch or None`` with the node's resourceVersion, retrying a
    conflict with a fresh read."""
    for _ in range(_CONFLICT_TRIES):
        node = api.checked("GET", _node_path(node_name))
        patch = change(node)
        if patch is None:
            return
        patch.setdefault("metadata", {})["resourceVersion"] = node["metadata"]["resourceVersion"]
        status, answer = api.request(
            "PATCH",
            _node_path(node_name),
            patch,
            content_type="application/merge-patch+json",
        )
        if status == 409:
            continue
        if status >= 300:
            raise DrainError(f"PATCH node {node_name}: {status} {answer.get('message', '')}")
        return
    raise DrainError(f"PATCH node {node_name}: still conflicting after {_CONFLICT_TRIES} tries")


def cordon(api: KubernetesApi, node_name: str, event_id: str) -> None:
    def change(node: JsonObject) -> JsonObject | None:
        events = _cordoned_for(node)
        unschedulable = bool(node.get("spec", {}).get("unschedulable"))
        if unschedulable and not events:
            log(f"node {node_name} was already cordoned by someone else: left to them to uncordon")
            return None
        if event_id in events and unschedulable:
            return None
        log(f"cordoning node {node_name} for event {event_id}")
        return {
            "spec": {"unschedulable": True},
            "metadata": {"annotations": {ANNOTATION: ",".join([*events, event_id])}},
        }

    _patch_node(api, node_name, change)


def uncordon(api: KubernetesApi, node_name: str, event_id: str) -> None:
    def change(node: JsonObject) -> JsonObject | None:
        events = _cordoned_for(node)
        if event_id not in events:
            return None  # not cordoned for this event (or by someone else): not ours to undo
        rest = [event for event in events if event != event_id]
        if rest:
            log(f"event {event_id} is over; node {node_name} stays cordoned for {rest}")
            return {"metadata": {"annotations": {ANNOTATION: ",".join(rest)}}}
        log(f"event {event_id} is over: node {node_name} is schedulable again")
        return {"spec": {"unschedulable": None}, "metadata": {"annotations": {ANNOTATION: None}}}

    _patch_node(api, node_name, change)


def _evictable(pod: JsonObject) -> bool:
    metadata = pod.get("metadata", {})
    if metadata.get("deletionTimestamp"):
        return False
    if _MIRROR in (metadata.get("annotations") or {}):
        return False
    if any(owner.get("kind") == "DaemonSet" for owner in metadata.get("ownerReferences") or []):
        return False
    return pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")


def _pods_on(api: KubernetesApi, node_name: str) -> list[JsonObject]:
    selector = urllib.parse.quote(f"spec.nodeName={node_name}", safe="")
    answer = api.checked("GET", f"/api/v1/pods?fieldSelector={selector}")
    items: list[JsonObject] = answer.get("items") or []
    return items


def _key(pod: JsonObject) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def drain(
    api: KubernetesApi,
    node_name: str,
    *,
    timeout: float,
    grace_period: int | None,
    retry_interval: float,
) -> None:
    """Evict every evictable pod of the node and wait until they are gone, within ``timeout``."""
    deadline = time.monotonic() + timeout
    pending = {_key(pod): pod for pod in _pods_on(api, node_name) if _evictable(pod)}
    log(f"evicting {len(pending)} pod(s) from node {node_name}")
    evicted: dict[str, str] = {}  # key -> uid
    while True:
        for key, pod in list(pending.items()):
            namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            body: JsonObject = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
            }
            if grace_period is not None:
                body["deleteOptions"] = {"gracePeriodSeconds": grace_period}
            path = (
                f"/api/v1/namespaces/{urllib.parse.quote(namespace, safe='')}"
                f"/pods/{urllib.parse.quote(name, safe='')}/eviction"
            )
            status, answer = api.request("POST", path, body)
            if status in (200, 201, 404):  # 404: already gone
                evicted[key] = pod["metadata"].get("uid", "")
                del pending[key]
            elif status == 429:  # a PodDisruptionBudget says not now
                log(f"eviction of {key} refused for now: {answer.get('message', '')}")
            else:
                raise DrainError(f"evicting {key}: {status} {answer.get('message', '')}")
        still = {
            _key(pod)
            for pod in _pods_on(api, node_name)
            if (_key(pod), pod["metadata"].get("uid", "")) in evicted.items()
        }
        if not pending and not still:
            log(f"node {node_name} is drained ({len(evicted)} pod(s) evicted)")
            return
        if time.monotonic() >= deadline:
            left = sorted(set(pending) | still)
            raise DrainError(f"node {node_name} not drained after {timeout:g} s: {left}")
        time.sleep(min(retry_interval, max(deadline - time.monotonic(), 0.0)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduled-events-drain-node",
        description="Cordon and drain this node before Azure maintenance (TRANSITION scheduled "
        "or started), uncordon it afterwards (completed or canceled). Reads TRANSITION, "
        "EVENT_TYPE and EVENT_ID from the environment, as the agent's hooks get them.",
    )
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="default $NODE_NAME")
    parser.add_argument(
        "--drain-types",
        default=",".join(DRAIN_TYPES),
        metavar="TYPES",
        help=f"EventTypes that drain the node (default {','.join(DRAIN_TYPES)})",
    )
    parser.add_argument(
        "--timeout", type=float, default=270.0, help="seconds to empty the node (default 270)"
    )
    parser.add_argument(
        "--grace-period",
        type=int,
        default=None,
        metavar="SECONDS",
        help="each pod's termination grace period (default: the pod's own)",
    )
    parser.add_argument(
        "--retry-interval", type=float, default=5.0, help="seconds between rounds (default 5)"
    )
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    in_cluster = f"https://{host}:{port}" if host and port else None
    if host and ":" in host:  # IPv6
        in_cluster = f"https://[{host}]:{port}"
    parser.add_argument(
        "--api-server", default=in_cluster, metavar="URL", help="default: the in-cluster address"
    )
    parser.add_argument("--token-file", default=f"{SERVICE_ACCOUNT}/token", metavar="FILE")
    parser.add_argument("--ca-file", default=f"{SERVICE_ACCOUNT}/ca.crt", metavar="FILE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    transition = os.environ.get("TRANSITION", "")
    event_type = os.environ.get("EVENT_TYPE", "")
    event_id = os.environ.get("EVENT_ID", "")
    drain_types = {t.strip() for t in args.drain_types.split(",") if t.strip()}
    if transition in DRAIN_ON and event_type not in drain_types:
        log(f"{event_type or 'no'} event {event_id}: not one of {sorted(drain_types)}: no drain")
        return 0
    if transition not in DRAIN_ON | UNCORDON_ON:
        log(f"transition {transition or '(none)'} of event {event_id}: nothing to do")
        return 0
    if not args.node or not event_id:
        log("usage: needs the node (--node or NODE_NAME) and EVENT_ID in the environment")
        return 2
    if not args.api_server:
        log("usage: not in a pod: give --api-server, --token-file and --ca-file")
        return 2
    try:
        with open(args.token_file, encoding="utf-8") as file:
            token = file.read().strip()
    except OSError as exc:
        log(f"cannot read the ServiceAccount token {args.token_file}: {exc}")
        return 2
    api = KubernetesApi(args.api_server, token, args.ca_file)
    try:
        if transition in UNCORDON_ON:
            uncordon(api, args.node, event_id)
        else:
            cordon(api, args.node, event_id)
            drain(
                api,
                args.node,
                timeout=args.timeout,
                grace_period=args.grace_period,
                retry_interval=args.retry_interval,
            )
    except DrainError as exc:
        log(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
