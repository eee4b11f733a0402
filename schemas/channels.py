"""The channels messages travel on, named the same for every transport.

RabbitMQ
    ``scheduled-events``             durable topic exchange: every lifecycle message, routing key
                                     ``<type>.<EventType>.<vm>`` (``started.Reboot.web-7``,
                                     ``approval-applied.Reboot.web-7``): always three words, the
                                     VM's name (lower case) last, so a broker permission can
                                     say "only keys that end in your own name"
    ``scheduled-events.vm-approvals`` durable topic exchange: approvals, routing key and each
                                     VM queue's binding key = the VM's name as in the events'
                                     keys (:func:`vm_word`): a VM's broker user may bind only
                                     its own key (topic permissions), so it reads only its own
    ``scheduled-events.unrouted``    the events exchange's alternate exchange (fanout) and the
                                     quorum queue bound to it: what is published while no
                                     consumer group is bound waits there, and goes back to the
                                     events exchange (dead-lettered, so unchanged) once one is
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
    "vm_word",
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
    #: A topic exchange (1.1; 1.0's direct ``scheduled-events.approvals`` is no longer used):
    #: the routing and binding key is :func:`vm_word`, so a broker permission can say "only
    #: your own approvals" (RabbitMQ checks topic permissions when a queue is bound).
    approvals_exchange: str = "scheduled-events.vm-approvals"
    events_topic: str = "scheduled-events"
    approvals_queue: str = "scheduled-events-approvals"
    #: Prefix of the per-group queues on RabbitMQ (``scheduled-events.group.audit``).
    group_prefix: str = "scheduled-events.group."
    #: Prefix of each VM's approvals queue on RabbitMQ (``scheduled-events.vm.web-7``).
    vm_prefix: str = "scheduled-events.vm."
    #: RabbitMQ: the events exchange's alternate exchange and its catch-all queue (one name):
    #: lifecycle messages published while no consumer group is bound wait there.
    unrouted: str = "scheduled-events.unrouted"

    def suffixed(self, suffix: str) -> ChannelNames:
        return replace(
            self,
            events_exchange=f"{self.events_exchange}-{suffix}",
            approvals_exchange=f"{self.approvals_exchange}-{suffix}",
            events_topic=f"{self.events_topic}-{suffix}",
            approvals_queue=f"{self.approvals_queue}-{suffix}",
            group_prefix=f"{self.group_prefix}{suffix}.",
            vm_prefix=f"{self.vm_prefix}{suffix}.",
            unrouted=f"{self.unrouted}-{suffix}",
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


def vm_word(vm: str) -> str:
    """The last word of every routing key a VM publishes with: its name in lower case, with
    ``.``, ``*``, ``#`` and spaces as ``_``. A per-VM broker user is named so (RabbitMQ topic
    permissions compare it with ``{username}``).

    >>> vm_word("Web.7")
    'web_7'
    """
    return _word(vm.casefold())


def routing_key(message_type: MessageType, event_type: str | None, vm: str) -> str:
    """``<type>.<EventType>.<vm>``: three words, the type's own dots as ``-``, agent messages
    with ``agent`` in the EventType slot, the VM last (:func:`vm_word`).

    >>> routing_key(MessageType.STARTED, "Reboot", "Web-7")
    'started.Reboot.web-7'
    >>> routing_key(MessageType.APPROVAL_APPLIED, "Reboot", "web-7")
    'approval-applied.Reboot.web-7'
    """
    kind = message_type.value.replace(".", "-")
    return f"{kind}.{_word(event_type or 'agent')}.{vm_word(vm)}"
