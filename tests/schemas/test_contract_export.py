"""The exported contract (JSON Schema, AsyncAPI) is regenerated from the code and must match
what is committed, so other languages never read a stale contract."""

from __future__ import annotations

from pathlib import Path

import yaml

from schemas.export import HERE, render_all


def test_the_committed_contract_files_are_what_the_code_generates() -> None:
    stale = [
        str(path)
        for path, text in render_all().items()
        if not (HERE / path).exists() or (HERE / path).read_text(encoding="utf-8") != text
    ]
    assert not stale, f"run `python -m schemas export` and commit: {stale}"


def test_the_asyncapi_document_names_both_brokers_channels_and_resolves_its_refs() -> None:
    document = yaml.safe_load((HERE / "asyncapi.yaml").read_text())
    assert document["asyncapi"] == "3.0.0"
    channels = document["channels"]
    assert channels["rabbitmqLifecycle"]["bindings"]["amqp"]["exchange"] == {
        "name": "scheduled-events",
        "type": "topic",
        "durable": True,
        "autoDelete": False,
        "vhost": "/",
    }
    assert channels["rabbitmqApprovals"]["bindings"]["amqp"]["exchange"]["type"] == "topic"
    assert channels["rabbitmqApprovals"]["address"] == "scheduled-events.vm-approvals"
    assert channels["servicebusLifecycle"]["address"] == "scheduled-events"
    assert channels["servicebusApprovals"]["address"] == "scheduled-events-approvals"
    assert "session id = the VM name" in channels["servicebusApprovals"]["description"]

    def resolve(ref: str) -> object:
        if ref.startswith("./"):
            return (HERE / ref).exists() or None
        node: object = document
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(node, dict), ref
            node = node[part]
        return node

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    assert resolve(value) is not None, value
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(document)
    assert len(document["operations"]) == 8


def test_every_message_kind_has_a_schema_file() -> None:
    names = {p.stem for p in (HERE / "jsonschema").glob("*.json")}
    assert names == {
        "transition",
        "approval-outcome",
        "agent",
        "hook-result",
        "approval",
        "scheduled-events-document",
    }
    assert Path(HERE / "asyncapi.yaml").exists()
