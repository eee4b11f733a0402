"""Which lifecycle messages a stream or a handler wants: by message type, EventType, VM,
resource group and scale set. Names compare case-insensitively, as Azure does."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas import LifecycleMessage, MessageType

__all__ = ["MessageFilter"]


def _names(value: str | Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({value.casefold()})
    return frozenset(v.casefold() for v in value)


KindsArg = MessageType | str | Iterable[MessageType | str] | None


def _kinds(value: KindsArg) -> frozenset[MessageType] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({MessageType(value)})
    return frozenset(MessageType(v) for v in value)


@dataclass(frozen=True, slots=True)
class MessageFilter:
    """Every criterion given must match; None matches anything.

    An ``event_types`` filter only matches messages about an event (agent messages have none).

    >>> wanted = MessageFilter.of(kinds=[MessageType.STARTED], event_type="Reboot", vm="web-7")
    """

    kinds: frozenset[MessageType] | None = None
    event_types: frozenset[str] | None = None
    vms: frozenset[str] | None = None
    resource_groups: frozenset[str] | None = None
    scale_sets: frozenset[str] | None = None

    @classmethod
    def of(
        cls,
        *,
        kinds: KindsArg = None,
        event_type: str | Iterable[str] | None = None,
        vm: str | Iterable[str] | None = None,
        resource_group: str | Iterable[str] | None = None,
        scale_set: str | Iterable[str] | None = None,
    ) -> MessageFilter:
        return cls(
            kinds=_kinds(kinds),
            event_types=_names(event_type),
            vms=_names(vm),
            resource_groups=_names(resource_group),
            scale_sets=_names(scale_set),
        )

    @property
    def matches_all(self) -> bool:
        return (
            self.kinds is None
            and self.event_types is None
            and self.vms is None
            and self.resource_groups is None
            and self.scale_sets is None
        )

    def matches(self, message: LifecycleMessage) -> bool:
        if self.kinds is not None and message.kind not in self.kinds:
            return False
        if self.event_types is not None:
            event_type = message.event_type
            if event_type is None or event_type.casefold() not in self.event_types:
                return False
        vm = message.vm
        if self.vms is not None and vm.name.casefold() not in self.vms:
            return False
        groups = self.resource_groups
        if groups is not None and vm.resource_group.casefold() not in groups:
            return False
        scale_sets = self.scale_sets
        return scale_sets is None or (vm.scale_set or "").casefold() in scale_sets
