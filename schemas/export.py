"""The exported contract, for consumers written in other languages.

``python -m schemas export`` writes a JSON Schema for every message under
``schemas/jsonschema/`` and the AsyncAPI 3.0 document ``schemas/asyncapi.yaml``;
``python -m schemas export --check`` fails when the committed files differ from the code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ._errors import ConfigError
from .approvals import Approval
from .channels import DEFAULT_CHANNELS, TYPE_PREFIX, MessageType
from .fingerprints import EVENT_VERSION_DEFINITION
from .imds import ScheduledEventsDocument
from .messages import (
    CLOUDEVENTS_CONTENT_TYPE,
    ENVELOPES,
    LIVENESS_PER_HEARTBEAT,
    dataschema_uri,
)
from .versioning import SCHEMA_VERSION

__all__ = ["HERE", "render_all", "write_all"]

HERE = Path(__file__).parent

_EXAMPLE_KEYS = {
    "transition": "started.Reboot.web-7",
    "approval-outcome": "approval-applied.Reboot.web-7",
    "agent": "agent-heartbeat.agent.web-7",
    "hook-result": "hook-completed.Reboot.web-7",
}


def _schema(model: type[BaseModel], name: str, title: str, description: str) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": dataschema_uri(name),
        **schema,
    }
    schema["title"] = title
    schema["description"] = description
    return schema


def json_schemas() -> dict[str, dict[str, Any]]:
    """Every message's JSON Schema by file stem."""
    out: dict[str, dict[str, Any]] = {}
    for envelope in ENVELOPES:
        kinds = sorted(kind.cloudevents_type for kind in envelope.kinds)
        schema = _schema(
            envelope,
            envelope.schema_name,
            envelope.__name__,
            f"A CloudEvents 1.0 lifecycle message (structured JSON, content type "
            f"{CLOUDEVENTS_CONTENT_TYPE}) of type {', '.join(kinds)}; schema version "
            f"{SCHEMA_VERSION}.",
        )
        schema["properties"]["type"]["enum"] = kinds
        schema["properties"]["specversion"] = {"const": "1.0", "type": "string"}
        schema["required"] = sorted({*schema.get("required", []), "specversion", "type"})
        out[envelope.schema_name] = schema
    out["approval"] = _schema(
        Approval,
        "approval",
        "Approval",
        "A signed approval, central service -> one VM (content type application/json). "
        "signature: base64 Ed25519 over the canonical JSON of every other field the signer "
        "wrote, including fields of newer minor versions (keys sorted, no spaces, UTF-8 not "
        "escaped, issued_at and expires_at as UTC YYYY-MM-DDTHH:MM:SS.ffffffZ). event_version: "
        "the version of the event its decider judged; the agent applies the approval only while "
        "the live event has that version. " + EVENT_VERSION_DEFINITION,
    )
    out["scheduled-events-document"] = _schema(
        ScheduledEventsDocument,
        "scheduled-events-document",
        "ScheduledEventsDocument",
        "The IMDS Scheduled Events document (GET /metadata/scheduledevents), any api-version.",
    )
    return out


def _message(name: str, title: str, summary: str, content_type: str) -> dict[str, Any]:
    return {
        "name": name,
        "title": title,
        "summary": summary,
        "contentType": content_type,
        "payload": {
            "schemaFormat": "application/schema+json;version=draft-2020-12",
            "schema": {"$ref": f"./jsonschema/{name}.json"},
        },
    }


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document: both brokers, both flows."""
    names = DEFAULT_CHANNELS
    lifecycle_refs = {stem: {"$ref": f"#/components/messages/{stem}"} for stem in _EXAMPLE_KEYS}
    approval_ref = {"approval": {"$ref": "#/components/messages/approval"}}
    types = ", ".join(f"`{kind.value}`" for kind in MessageType)
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "scheduled-events-relay",
            "version": SCHEMA_VERSION,
            "description": (
                "Azure IMDS Scheduled Events as a fleet-wide stream. Every VM's agent publishes "
                "a CloudEvents 1.0 lifecycle message for every change of every event; central "
                "services send signed approvals back to one VM, which applies them with IMDS "
                f"StartRequests. CloudEvents types are `{TYPE_PREFIX}.<suffix>` with suffix one "
                f"of {types}. The context attributes also travel as application properties "
                "with the `cloudEvents:` prefix (AMQP binding)."
            ),
        },
        "defaultContentType": CLOUDEVENTS_CONTENT_TYPE,
        "servers": {
            "rabbitmq": {
                "host": "localhost:5672",
                "protocol": "amqp",
                "protocolVersion": "0.9.1",
                "description": "RabbitMQ (or any AMQP 0-9-1 broker).",
            },
            "servicebus": {
                "host": "{namespace}.servicebus.windows.net",
                "protocol": "amqps",
                "protocolVersion": "1.0",
                "description": "Azure Service Bus, Standard or Premium tier (sessions).",
                "variables": {"namespace": {"description": "The Service Bus namespace."}},
            },
        },
        "channels": {
            "rabbitmqLifecycle": {
                "address": names.events_exchange,
                "title": "Lifecycle stream (RabbitMQ)",
                "description": (
                    "Durable topic exchange with the argument `alternate-exchange` = "
                    f"`{names.unrouted}` (a fanout exchange into the quorum queue of that name, "
                    "which keeps what is published before any group exists and hands it to the "
                    "first group declared). Routing key "
                    "`<type>.<EventType>.<vm>`, always three words: the type with its dots as "
                    "`-`, the VM's name in lower case last (`started.Reboot.web-7`, "
                    "`approval-applied.Reboot.web-7`; agent messages "
                    "have `agent` as EventType). Each consumer group reads a durable quorum queue "
                    f"`{names.group_prefix}<group>` bound with `#`."
                ),
                "servers": [{"$ref": "#/servers/rabbitmq"}],
                "messages": lifecycle_refs,
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {
                            "name": names.events_exchange,
                            "type": "topic",
                            "durable": True,
                            "autoDelete": False,
                            "vhost": "/",
                        },
                        "bindingVersion": "0.3.0",
                    }
                },
            },
            "rabbitmqApprovals": {
                "address": names.approvals_exchange,
                "title": "Approvals (RabbitMQ)",
                "description": (
                    "Durable topic exchange; the routing key is the VM's name as the last word "
                    "of its lifecycle keys (lower case, `.` `*` `#` and spaces as `_`). Each "
                    f"agent consumes its durable queue `{names.vm_prefix}<vm>` bound with that "
                    "one key, with a message TTL; a VM's broker user may bind only its own key."
                ),
                "servers": [{"$ref": "#/servers/rabbitmq"}],
                "messages": approval_ref,
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {
                            "name": names.approvals_exchange,
                            "type": "topic",
                            "durable": True,
                            "autoDelete": False,
                            "vhost": "/",
                        },
                        "bindingVersion": "0.3.0",
                    }
                },
            },
            "servicebusLifecycle": {
                "address": names.events_topic,
                "title": "Lifecycle stream (Service Bus)",
                "description": (
                    "Topic with duplicate detection; message_id is the CloudEvent id, subject "
                    "the routing key. Each consumer group reads the subscription of its name."
                ),
                "servers": [{"$ref": "#/servers/servicebus"}],
                "messages": lifecycle_refs,
            },
            "servicebusApprovals": {
                "address": names.approvals_queue,
                "title": "Approvals (Service Bus)",
                "description": (
                    "Session-enabled queue; session id = the VM name, so each agent, holding its "
                    "own session, receives only its own approvals."
                ),
                "servers": [{"$ref": "#/servers/servicebus"}],
                "messages": approval_ref,
            },
        },
        "operations": {
            f"{verb}{broker.capitalize()}{flow}": {
                "action": action,
                "channel": {"$ref": f"#/channels/{broker}{flow}"},
                "summary": summary,
                "messages": [
                    {"$ref": f"#/channels/{broker}{flow}/messages/{stem}"}
                    for stem in (_EXAMPLE_KEYS if flow == "Lifecycle" else ("approval",))
                ],
            }
            for broker in ("rabbitmq", "servicebus")
            for verb, action, flow, summary in (
                ("publish", "send", "Lifecycle", "An agent publishes what happened on its VM."),
                ("consume", "receive", "Lifecycle", "A consumer group reads the fleet stream."),
                ("send", "send", "Approvals", "A central service approves an event for one VM."),
                ("receive", "receive", "Approvals", "An agent reads the approvals for its VM."),
            )
        },
        "components": {
            "messages": {
                "transition": _message(
                    "transition",
                    "Transition",
                    "scheduled, started, updated, completed or canceled",
                    CLOUDEVENTS_CONTENT_TYPE,
                ),
                "approval-outcome": _message(
                    "approval-outcome",
                    "Approval outcome",
                    "approval.applied or approval.rejected (with the reason)",
                    CLOUDEVENTS_CONTENT_TYPE,
                ),
                "agent": _message(
                    "agent",
                    "Agent",
                    "agent.online, agent.heartbeat or agent.offline (a heartbeat goes once the "
                    "agent's heartbeat interval, 60 s by default, went by without any other "
                    "message: any message says the agent is alive; each of these says the "
                    f"interval, and consumers count the agent live for {LIVENESS_PER_HEARTBEAT:g} "
                    "of them)",
                    CLOUDEVENTS_CONTENT_TYPE,
                ),
                "hook-result": _message(
                    "hook-result",
                    "Hook result",
                    "hook.completed: a local hook ran on a transition",
                    CLOUDEVENTS_CONTENT_TYPE,
                ),
                "approval": _message(
                    "approval",
                    "Approval",
                    "A signed approval for one VM",
                    "application/json",
                ),
            }
        },
    }


def render_all() -> dict[Path, str]:
    """Every exported file's path (relative to the package) and text."""
    try:
        import yaml  # the dev extra: exporting is a development step, not a runtime one
    except ImportError as exc:
        raise ConfigError(
            "exporting the contract needs PyYAML, in the dev extra: "
            "pip install 'scheduled-events-relay[dev]'"
        ) from exc

    files = {
        Path("jsonschema") / f"{stem}.json": json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for stem, schema in json_schemas().items()
    }

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    files[Path("asyncapi.yaml")] = yaml.dump(
        asyncapi(), Dumper=_NoAliases, sort_keys=False, width=100
    )
    return files


def write_all(root: Path = HERE) -> list[Path]:
    written = []
    for relative, text in render_all().items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
