"""The channels messages travel on, named the same for every transport.

RabbitMQ
    ``scheduled-events``             durable topic exchange: every lifecycle message, routing key
                                     ``<type-suffix>.<EventType>.<vm>`` (``started.Reboot.web-7``)
    ``scheduled-events.approvals``   durable direct exchange: approvals, routing key = VM name
Azure Service Bus
    ``scheduled-events``             topic: every lifecycle message; one subscription per group
    ``scheduled-events-approvals``   session-enabled queue: approvals, session id = VM name

A consumer group (``approver``, ``audit``, ...) reads its own copy of the stream: a durable
quorum queue bound to the topic exchange on RabbitMQ, a topic subscription on Service Bus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_CHANNELS",
    "TYPE_PREFIX",
    "ChannelNames",
    "MessageType",
    "ReplyAddress",
    "routing_key",
]

#: The reverse-DNS prefix of every CloudEvents ``type`` this project emits.
TYPE_PREFIX = "io.github.scheduledeventsrelay"


class MessageType(StrEnum):
    """The suffix of a CloudEvents ``type``: ``f"{TYPE_PREFIX}.{MessageType.STARTED}"``."""

    SCHEDULED = "scheduled"
    STARTED = "started"
    UPDATED = "updated"
    COMPLETED = "completed"
    CANCELED = "canceled"
    APPROVAL_APPLIED = "approval.applied"
    APPROVAL_REJECTED = "approval.rejected"
    AGENT_ONLINE = "agent.online"
    AGENT_HEARTBEAT = "agent.heartbeat"
    AGENT_OFFLINE = "agent.offline"
    HOOK_COMPLETED = "hook.completed"

    @property
    def cloudevents_type(self) -> str:
        return f"{TYPE_PREFIX}.{self.value}"

    @classmethod
    def from_cloudevents_type(cls, value: str) -> MessageType | None:
        prefix = TYPE_PREFIX + "."
        if not value.startswith(prefix):
            return None
        try:
            return cls(value[len(prefix) :])
        except ValueError:
            return None

    @property
    def is_transition(self) -> bool:
        return self in _TRANSITIONS

    @property
    def is_agent(self) -> bool:
        return self.value.startswith("agent.")


_TRANSITIONS = frozenset(
    {
        MessageType.SCHEDULED,
        MessageType.STARTED,
        MessageType.UPDATED,
        MessageType.COMPLETED,
        MessageType.CANCELED,
    }
)


@dataclass(frozen=True, slots=True)
class ChannelNames:
    """Broker entity names. Tests use :meth:`suffixed` for names of their own."""

    events_exchange: str = "scheduled-events"
    approvals_exchange: str = "scheduled-events.approvals"
    events_topic: str = "scheduled-events"
    approvals_queue: str = "scheduled-events-approvals"
    #: Prefix of the per-group queues on RabbitMQ (``scheduled-events.group.audit``).
    group_prefix: str = "scheduled-events.group."
    #: Prefix of each VM's approvals queue on RabbitMQ (``scheduled-events.vm.web-7``).
    vm_prefix: str = "scheduled-events.vm."

    def suffixed(self, suffix: str) -> ChannelNames:
        return replace(
            self,
            events_exchange=f"{self.events_exchange}-{suffix}",
            approvals_exchange=f"{self.approvals_exchange}-{suffix}",
            events_topic=f"{self.events_topic}-{suffix}",
            approvals_queue=f"{self.approvals_queue}-{suffix}",
            group_prefix=f"{self.group_prefix}{suffix}.",
            vm_prefix=f"{self.vm_prefix}{suffix}.",
        )


DEFAULT_CHANNELS = ChannelNames()


class ReplyAddress(BaseModel):
    """Where approvals for one VM go: the approvals channel and the key that selects the VM
    (the routing key on RabbitMQ, the session id on Service Bus)."""

    model_config = ConfigDict(frozen=True)

    channel: str = Field(min_length=1)
    key: str = Field(min_length=1)

    def __str__(self) -> str:
        return f"{self.channel}/{self.key}"


_WORD_UNSAFE = re.compile(r"[.#*\s]")


def _word(value: str) -> str:
    # A topic routing key is dot-separated words: a dot inside a VM name (Linux VM names may
    # have one) would shift every later word, so it becomes "_", as do the wildcards.
    return _WORD_UNSAFE.sub("_", value) or "_"


def routing_key(message_type: MessageType, event_type: str | None, vm: str) -> str:
    """``<type-suffix>.<EventType>.<vm>``; agent messages have ``agent`` in the EventType slot.

    >>> routing_key(MessageType.STARTED, "Reboot", "web-7")
    'started.Reboot.web-7'
    """
    return f"{message_type.value}.{_word(event_type or 'agent')}.{_word(vm)}"
