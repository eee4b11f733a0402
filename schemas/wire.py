"""How contract messages are laid on a transport, the same for every broker.

Lifecycle messages travel in CloudEvents structured mode (content type
``application/cloudevents+json``); their context attributes are also copied into application
properties with the AMQP binding's ``cloudEvents:`` prefix, so broker-side filters (Service Bus
SQL filters, RabbitMQ headers exchanges) can select on them without parsing the body.
"""

from __future__ import annotations

from datetime import UTC, datetime

from .approvals import APPROVAL_CONTENT_TYPE, Approval
from .messages import CLOUDEVENTS_CONTENT_TYPE, LifecycleMessage
from .transport._base import OutgoingMessage, PropertyValue

__all__ = ["CE_PREFIX", "approval_message", "lifecycle_message"]

#: The CloudEvents AMQP binding's prefix for attributes carried as application properties.
CE_PREFIX = "cloudEvents:"


def lifecycle_message(message: LifecycleMessage) -> OutgoingMessage:
    properties: dict[str, PropertyValue] = {
        f"{CE_PREFIX}specversion": message.specversion,
        f"{CE_PREFIX}id": message.id,
        f"{CE_PREFIX}source": message.source,
        f"{CE_PREFIX}type": message.type,
        f"{CE_PREFIX}time": message.time.astimezone(UTC).isoformat(),
        f"{CE_PREFIX}dataschema": message.dataschema,
        f"{CE_PREFIX}sequence": message.sequence,
        f"{CE_PREFIX}schemaversion": message.schemaversion,
        "vm": message.vm.name,
    }
    if message.subject is not None:
        properties[f"{CE_PREFIX}subject"] = message.subject
    if message.event_type is not None:
        properties["eventtype"] = message.event_type
    return OutgoingMessage(
        body=message.to_bytes(),
        message_id=message.id,
        content_type=CLOUDEVENTS_CONTENT_TYPE,
        routing_key=message.routing_key,
        properties=properties,
    )


def approval_message(approval: Approval, *, now: datetime | None = None) -> OutgoingMessage:
    """An approval on the wire: its id is the message id (so a repeat send is dropped where the
    broker deduplicates), and it expires from the queue when the approval expires."""
    moment = now or datetime.now(UTC)
    ttl = max((approval.expires_at - moment).total_seconds(), 1.0)
    return OutgoingMessage(
        body=approval.to_bytes(),
        message_id=approval.approval_id,
        content_type=APPROVAL_CONTENT_TYPE,
        routing_key=approval.vm,
        properties={"event_id": approval.event_id, "vm": approval.vm},
        ttl_seconds=ttl,
    )
