"""The VMs of a simulator: their names, where they sit, and what each one's document lists.

A VM's record holds its DocumentIncarnation and the ids of the events its document lists (the
ledger changes both); the fleet itself knows the delivery groups (an availability set, a
scale-set placement group) and deals each group an ordinal in order of appearance, which is what
shards split on. Identities are computed on first use: a fleet of 10,000 starts at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ._errors import DuplicateVmError, InvalidVmNameError, UnknownVmError
from ._identity import Placement, VmIdentity, identity_for
from ._topology import Membership, implicit_membership

__all__ = ["VM_NAME_PATTERN", "Fleet", "FleetVm"]

VM_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")


@dataclass(slots=True)
class FleetVm:
    """One VM as the simulator holds it."""

    name: str
    index: int
    membership: Membership
    group: str | None
    slot: int  # the ordinal of its delivery group (or of itself, alone) in order of appearance
    identity: VmIdentity | None = None
    incarnation: int = 1
    events: dict[str, None] = field(default_factory=dict)  # an ordered set of live event ids


class Fleet:
    """Every VM, in the order added, and the delivery groups they form."""

    def __init__(self, placement: Placement) -> None:
        self._placement = placement
        self._vms: dict[str, FleetVm] = {}
        self._groups: dict[str, list[str]] = {}  # delivery group -> its VMs, in order added
        self._slots: dict[str, int] = {}  # delivery group -> its ordinal
        self._next_slot = 0

    def add(self, name: str, membership: Membership | None = None) -> FleetVm:
        """Add a VM; without ``membership``, its name says where it sits (see ``_topology``)."""
        if not VM_NAME_PATTERN.match(name):
            raise InvalidVmNameError(
                f"bad VM name {name!r}: use letters, digits, '.', '_' or '-' (at most 80)"
            )
        if name in self._vms:
            raise DuplicateVmError(f"VM {name!r} exists already")
        index = len(self._vms)
        if membership is None:
            membership = implicit_membership(name, index)
        group = membership.group
        if group is None:
            slot = self._new_slot()
        else:
            self._groups.setdefault(group, []).append(name)
            slot = self._slots.get(group, -1)
            if slot < 0:
                slot = self._slots[group] = self._new_slot()
        vm = self._vms[name] = FleetVm(name, index, membership, group, slot)
        return vm

    def _new_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def get(self, name: str) -> FleetVm:
        """The VM called ``name``; UnknownVmError when there is none."""
        try:
            return self._vms[name]
        except KeyError:
            raise UnknownVmError(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._vms

    def __len__(self) -> int:
        return len(self._vms)

    def names(self) -> list[str]:
        return list(self._vms)

    def identity(self, name: str) -> VmIdentity:
        vm = self.get(name)
        if vm.identity is None:  # computed on first use: 10,000 VMs start instantly
            vm.identity = identity_for(vm.name, vm.index, self._placement, vm.membership)
        return vm.identity

    def group_of(self, name: str) -> tuple[str, ...]:
        """The VMs that see each other's events with ``name`` (itself included)."""
        group = self.get(name).group
        return (name,) if group is None else tuple(self._groups[group])

    def audience(self, resources: Iterable[str]) -> tuple[str, ...]:
        """The VMs of ``resources`` and the rest of their sets and placement groups, in order."""
        vms, groups = self._vms, self._groups
        seen: dict[str, None] = {}
        done: set[str] = set()
        for name in resources:
            group = vms[name].group
            if group is None:
                seen[name] = None
            elif group not in done:
                done.add(group)
                seen.update(dict.fromkeys(groups[group]))
        return tuple(seen)

    def describe(self) -> dict[str, Any]:
        """The fleet by scale set (and its placement groups), availability set, standalone VM."""
        scale_sets: dict[str, dict[str, dict[str, Any]]] = {}
        availability_sets: dict[str, list[str]] = {}
        standalone: list[str] = []
        for name, vm in self._vms.items():
            m = vm.membership
            if m.scale_set:
                groups = scale_sets.setdefault(m.scale_set, {})
                group = groups.setdefault(
                    m.placement_group_id, {"id": m.placement_group_id, "zone": m.zone, "vms": []}
                )
                group["vms"].append(name)
            elif m.availability_set:
                availability_sets.setdefault(m.availability_set, []).append(name)
            else:
                standalone.append(name)
        return {
            "scale_sets": [
                {
                    "name": scale_set,
                    "vms": sum(len(g["vms"]) for g in groups.values()),
                    "placement_groups": list(groups.values()),
                }
                for scale_set, groups in scale_sets.items()
            ],
            "availability_sets": [
                {"name": name, "vms": vms} for name, vms in availability_sets.items()
            ],
            "standalone": standalone,
        }
