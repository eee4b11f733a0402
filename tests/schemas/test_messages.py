"""Lifecycle messages: golden fixtures round-trip, an independent CloudEvents parser and the
exported JSON Schemas accept them, versions are read by the documented rule, ids are stable."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cloudevents.core.formats.json import JSONFormat

from schemas import (
    SCHEMA_VERSION,
    MessageType,
    ReplyAddress,
    ScheduledEventsDocument,
    SchemaError,
    TransitionMessage,
    UnknownMessageType,
    VersionMismatch,
    VmIdentity,
    decode,
    diff,
    revisions_after,
)
from schemas.wire import CE_PREFIX, lifecycle_message

ROOT = Path(__file__).parent.parent
MESSAGE_FIXTURES = sorted(
    p
    for p in (ROOT / "fixtures").glob("*/*.json")
    if p.parent.name[0].isdigit() and p.stem != "approval"
)
SCHEMA_DIR = ROOT.parent / "schemas" / "jsonschema"
SCHEMA_OF = {
    "transition": {"scheduled", "started", "updated", "completed", "canceled"},
    "approval-outcome": {"approval.applied", "approval.rejected"},
    "agent": {"agent.online", "agent.heartbeat", "agent.offline"},
    "hook-result": {"hook.completed"},
}


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_there_is_a_golden_fixture_for_every_message_type() -> None:
    stems = {p.stem for p in MESSAGE_FIXTURES if p.parent.name == SCHEMA_VERSION}
    assert stems == {kind.value for kind in MessageType}


def _contains(whole: object, part: object) -> bool:
    """Every field of ``part`` is in ``whole`` with the same value (``whole`` may add fields)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            key in whole and _contains(whole[key], value) for key, value in part.items()
        )
    return whole == part


@pytest.mark.parametrize("path", MESSAGE_FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_fixture_decodes_and_encodes_back_to_the_same_json(path: Path) -> None:
    """Messages of this version come back exactly; those of an older minor version keep every
    field they had (the fields this version added take their defaults), and the bytes as
    received are kept whole."""
    raw = _load(path)
    message = decode(path.read_bytes())
    assert message.kind.value == path.stem
    assert message.received_bytes == path.read_bytes()
    if path.parent.name == SCHEMA_VERSION:
        assert json.loads(message.to_bytes()) == raw
    else:
        assert _contains(json.loads(message.to_bytes()), raw)


@pytest.mark.parametrize("path", MESSAGE_FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_official_cloudevents_sdk_accepts_every_message(path: Path) -> None:
    event = JSONFormat().read(None, path.read_bytes())
    raw = _load(path)
    assert event.get_id() == raw["id"]
    assert event.get_type() == raw["type"]
    assert event.get_source() == raw["source"]
    assert event.get_extension("sequence") == raw["sequence"]
    assert event.get_data() == raw["data"]


@pytest.mark.parametrize("path", MESSAGE_FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_exported_json_schema_validates_every_fixture(path: Path) -> None:
    (name,) = [name for name, kinds in SCHEMA_OF.items() if path.stem in kinds]
    schema = _load(SCHEMA_DIR / f"{name}.json")
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_load(path), schema, cls=jsonschema.Draft202012Validator)
    # and rejects the same message under another envelope's type
    wrong = dict(_load(path), type="io.github.scheduledeventsrelay.not-a-type")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema, cls=jsonschema.Draft202012Validator)


def test_the_approval_and_document_schemas_validate_their_fixtures() -> None:
    approval_schema = _load(SCHEMA_DIR / "approval.json")
    jsonschema.validate(
        _load(ROOT / "fixtures" / SCHEMA_VERSION / "approval.json"), approval_schema
    )
    document_schema = _load(SCHEMA_DIR / "scheduled-events-document.json")
    for path in (ROOT / "fixtures" / "imds").glob("20*.json"):
        jsonschema.validate(_load(path), document_schema)


def _fixture(name: str) -> dict[str, Any]:
    return _load(ROOT / "fixtures" / SCHEMA_VERSION / f"{name}.json")


@pytest.mark.parametrize("interval", [0, -60, 3600.5, 1e300, "soon", "60", True, [60]])
def test_a_heartbeat_interval_out_of_bounds_is_refused(interval: object) -> None:
    """What an agent declares decides how long consumers count it live: a VM that claims
    forever (or nothing sensible) is refused with its message, never believed."""
    raw = _fixture("agent.heartbeat")
    raw["data"]["heartbeat_interval"] = interval
    with pytest.raises(SchemaError, match="heartbeat_interval"):
        decode(json.dumps(raw))


def test_a_heartbeat_interval_within_bounds_or_absent_decodes() -> None:
    for interval, expected in ((3600, 3600.0), (0.5, 0.5), (None, None)):
        raw = _fixture("agent.heartbeat")
        raw["data"]["heartbeat_interval"] = interval
        message = decode(json.dumps(raw))
        assert message.data.heartbeat_interval == expected  # type: ignore[union-attr]
    raw = _fixture("agent.heartbeat")
    del raw["data"]["heartbeat_interval"]  # an agent of 1.1
    assert decode(json.dumps(raw)).data.heartbeat_interval is None  # type: ignore[union-attr]


def test_a_newer_minor_version_decodes_and_ignores_what_it_added() -> None:
    raw = _fixture("started")
    raw["schemaversion"] = "1.7"
    raw["priority"] = "high"
    raw["data"]["impact"] = {"network": True}
    message = decode(json.dumps(raw))
    assert message.kind is MessageType.STARTED
    assert message.schemaversion == "1.7"


def test_an_unknown_major_version_fails_naming_both_versions() -> None:
    raw = _fixture("started")
    raw["schemaversion"] = "2.0"
    with pytest.raises(
        VersionMismatch, match=rf"'2\.0'.*major version 1.*'{re.escape(SCHEMA_VERSION)}'"
    ):
        decode(json.dumps(raw))


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda raw: b"\xff not json", SchemaError),
        (lambda raw: b"[1, 2]", SchemaError),
        (lambda raw: json.dumps({**raw, "specversion": "0.3"}), SchemaError),
        (
            lambda raw: json.dumps({k: v for k, v in raw.items() if k != "schemaversion"}),
            SchemaError,
        ),
        (lambda raw: json.dumps({**raw, "type": "com.example.other"}), UnknownMessageType),
        (lambda raw: json.dumps({**raw, "sequence": -1}), SchemaError),
        (lambda raw: json.dumps({**raw, "data": {"vm": {}}}), SchemaError),
    ],
    ids=[
        "not-json",
        "not-object",
        "old-specversion",
        "no-version",
        "foreign-type",
        "bad-sequence",
        "bad-data",
    ],
)
def test_bad_input_is_a_schema_error_with_a_reason(mutate: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(mutate(_fixture("scheduled")))


def _transition_messages(vm_name: str, documents: list[dict[str, Any]]) -> list[TransitionMessage]:
    vm = VmIdentity(
        name=vm_name,
        resource_id=f"/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/{vm_name}",
    )
    reply = ReplyAddress(channel="scheduled-events.approvals", key=vm_name)
    previous = None
    revisions: dict[str, int] = {}
    out = []
    for raw in documents:
        document = ScheduledEventsDocument.from_imds(raw)
        transitions = diff(previous, document, revisions)
        for transition in transitions:
            out.append(
                TransitionMessage.build(
                    transition, vm=vm, reply_to=reply, observed_at=datetime.now(UTC)
                )
            )
        revisions = revisions_after(revisions, transitions, document)
        previous = document
    return out


def test_ids_are_the_same_for_the_same_transition_across_runs_and_differ_across_vms() -> None:
    documents = json.loads((ROOT / "fixtures" / "imds" / "westno-live-migration.json").read_text())
    first = [m.id for m in _transition_messages("WestNO_0", documents)]
    again = [m.id for m in _transition_messages("WestNO_0", documents)]
    other = [m.id for m in _transition_messages("WestNO_1", documents)]
    assert first == again
    assert len(set(first)) == 3
    assert not set(first) & set(other)


def test_two_different_updates_of_one_event_get_different_ids() -> None:
    base = _fixture("scheduled")["data"]["event"]
    docs = [
        {"DocumentIncarnation": 1, "Events": [base]},
        {
            "DocumentIncarnation": 2,
            "Events": [{**base, "NotBefore": "Mon, 11 Apr 2022 22:31:58 GMT"}],
        },
        {
            "DocumentIncarnation": 3,
            "Events": [{**base, "NotBefore": "Mon, 11 Apr 2022 22:36:58 GMT"}],
        },
    ]
    updates = [m for m in _transition_messages("WestNO_0", docs) if m.kind is MessageType.UPDATED]
    assert len({m.id for m in updates}) == 2


def test_an_update_back_to_earlier_content_is_a_new_happening_with_a_new_id() -> None:
    """A -> B -> A -> B: the second A->B is not the first one again (consumers, the audit and
    Service Bus duplicate detection would drop it)."""
    base = _fixture("scheduled")["data"]["event"]
    later = {**base, "NotBefore": "Mon, 11 Apr 2022 22:31:58 GMT"}
    docs = [{"DocumentIncarnation": n, "Events": [e]} for n, e in enumerate([base, later] * 2)]
    messages = _transition_messages("WestNO_0", docs)
    assert [m.kind.value for m in messages] == ["scheduled", "updated", "updated", "updated"]
    assert len({m.id for m in messages}) == 4
    assert [m.data.revision for m in messages] == [0, 1, 2, 3]


def test_on_the_wire_the_attributes_travel_as_amqp_properties_and_the_routing_key_is_set() -> None:
    message = decode(json.dumps(_fixture("started")))
    outgoing = lifecycle_message(message)
    assert outgoing.content_type == "application/cloudevents+json"
    assert outgoing.message_id == message.id
    assert outgoing.routing_key == "started.Freeze.westno_0"
    assert outgoing.properties[f"{CE_PREFIX}type"] == message.type
    assert outgoing.properties[f"{CE_PREFIX}sequence"] == message.sequence
    agent = decode(json.dumps(_fixture("agent.heartbeat")))
    assert lifecycle_message(agent).routing_key == "agent-heartbeat.agent.westno_0"
    outcome = decode(json.dumps(_fixture("approval.applied")))
    # every routing key is three words, the VM's name last: a broker permission can say
    # "only keys that end in your own name"
    assert lifecycle_message(outcome).routing_key == "approval-applied.Freeze.westno_0"
