"""A fake Kubernetes API server, over HTTPS, for the drain hook's tests.

It is a fake because no cluster runs here: it answers only the calls the hook makes (get and
merge-patch a node, list pods by node, create an eviction), the way the API server does
(resourceVersion conflicts, 429 from a PodDisruptionBudget, 404 for a pod already gone, 401
without the right bearer token), and records each call as the RBAC verb and resource it needs,
so a test can compare what the hook used with what its ClusterRole grants.
"""

from __future__ import annotations

import copy
import datetime
import ipaddress
import json
import re
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TOKEN = "fake-service-account-token"

_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_EVICTION = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")


def pod(
    name: str,
    node: str,
    *,
    namespace: str = "default",
    owner: str | None = "ReplicaSet",
    phase: str = "Running",
    mirror: bool = False,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}"}
    if owner:
        metadata["ownerReferences"] = [{"kind": owner, "name": f"{name}-owner"}]
    if mirror:
        metadata["annotations"] = {"kubernetes.io/config.mirror": "abc"}
    return {"metadata": metadata, "spec": {"nodeName": node}, "status": {"phase": phase}}


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            child = target.get(key)
            if not isinstance(child, dict):
                child = target[key] = {}
            _merge(child, value)
        else:
            target[key] = value


@dataclass
class FakeKubernetes:
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    #: namespace/name -> how many more evictions to refuse with 429
    budgets: dict[str, int] = field(default_factory=dict)
    #: how many node patches to refuse with 409 (someone else changed the node)
    conflicts: int = 0
    #: (verb, resource) of every authorised call, in order
    calls: list[tuple[str, str]] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_node(self, name: str, *, unschedulable: bool = False) -> None:
        spec = {"unschedulable": True} if unschedulable else {}
        self.nodes[name] = {"metadata": {"name": name, "resourceVersion": "1"}, "spec": spec}

    def node(self, name: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.nodes[name])

    # -- the API --------------------------------------------------------------------------

    def handle(
        self, method: str, url: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {"kind": "Status", "message": "Unauthorized", "code": 401}
        split = urlsplit(url)
        path = split.path
        with self.lock:
            if (found := _NODE.match(path)) and method in ("GET", "PATCH"):
                return self._node(method, unquote(found.group(1)), headers, body)
            if path == "/api/v1/pods" and method == "GET":
                self.calls.append(("list", "pods"))
                return self._list_pods(parse_qs(split.query))
            if (found := _EVICTION.match(path)) and method == "POST":
                self.calls.append(("create", "pods/eviction"))
                return self._evict(unquote(found.group(1)), unquote(found.group(2)), body)
        return 404, {"kind": "Status", "message": f"no route for {method} {path}", "code": 404}

    def _node(
        self, method: str, name: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        self.calls.append(("get" if method == "GET" else "patch", "nodes"))
        node = self.nodes.get(name)
        if node is None:
            return 404, {"kind": "Status", "message": f'nodes "{name}" not found', "code": 404}
        if method == "GET":
            return 200, copy.deepcopy(node)
        if headers.get("Content-Type") != "application/merge-patch+json":
            return 415, {"kind": "Status", "message": "unsupported patch type", "code": 415}
        patch = json.loads(body)
        wanted = patch.get("metadata", {}).pop("resourceVersion", None)
        if self.conflicts > 0 or (wanted and wanted != node["metadata"]["resourceVersion"]):
            self.conflicts = max(self.conflicts - 1, 0)
            node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
            return 409, {"kind": "Status", "message": "the object has been modified", "code": 409}
        _merge(node, patch)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        if not node["metadata"].get("annotations"):
            node["metadata"].pop("annotations", None)
        return 200, copy.deepcopy(node)

    def _list_pods(self, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        # A pod being deleted is listed once more, then it is gone (its containers stopped).
        self.pods = [p for p in self.pods if not p["metadata"].get("_gone_next")]
        for p in self.pods:
            if p["metadata"].get("deletionTimestamp"):
                p["metadata"]["_gone_next"] = True
        selector = query.get("fieldSelector", [""])[0]
        node = selector.removeprefix("spec.nodeName=")
        items = [copy.deepcopy(p) for p in self.pods if not node or p["spec"]["nodeName"] == node]
        for item in items:
            item["metadata"].pop("_gone_next", None)
        return 200, {"kind": "PodList", "items": items}

    def _evict(self, namespace: str, name: str, body: bytes) -> tuple[int, dict[str, Any]]:
        eviction = json.loads(body)
        assert eviction["kind"] == "Eviction", eviction
        assert eviction["metadata"] == {"name": name, "namespace": namespace}, eviction
        key = f"{namespace}/{name}"
        target = next(
            (
                p
                for p in self.pods
                if p["metadata"]["namespace"] == namespace and p["metadata"]["name"] == name
            ),
            None,
        )
        if target is None or target["metadata"].get("deletionTimestamp"):
            return 404, {"kind": "Status", "message": f'pods "{name}" not found', "code": 404}
        if self.budgets.get(key, 0) > 0:
            self.budgets[key] -= 1
            return 429, {
                "kind": "Status",
                "message": "Cannot evict pod as it would violate the pod's disruption budget.",
                "code": 429,
            }
        target["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        self.evicted.append(key)
        return 201, {"kind": "Status", "status": "Success", "code": 201}


def _certificate(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kube-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "ca.crt", directory / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@contextmanager
def serve(api: FakeKubernetes, directory: Path) -> Iterator[tuple[str, Path]]:
    """Serve ``api`` on https://127.0.0.1:<free port>; yields the URL and the CA file."""
    cert_file, key_file = _certificate(directory)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            status, answer = api.handle(self.command, self.path, self.headers, body)
            raw = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_PATCH = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert_file
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
