"""Where VMs sit: scale sets (placement groups, zones), availability sets, standalone VMs.

It matters for more than instance metadata: Azure delivers an event to *every* VM of the
availability set or scale-set placement group of the VMs it affects (``Resources`` names only
those), and any VM that sees it may approve it. A standalone VM sees only its own events.

The rules are pure functions of the topology, so the same topology gives the same identities in
every process (see ``--shard``)::

    scale set S, instance n, zones Z (empty: regional), placement group size P,
    fault domains F, update domains U:
        zone            Z[n % len(Z)]                 ("" when regional)
        placement group the k-th of that zone, k = (n // len(Z)) // P  (n // P when regional)
                        id = uuid5(S, zone, k): a group never spans zones
        fault domain    n % F        update domain  n % U
    availability set A, its i-th VM: fault domain i % F, update domain i % U, no zone
    a VM added by name alone:
        "S_n"  instance n of an implicit scale set S over zones 1-3 (P 100, F 5, U 5)
        other  standalone; zone, domains from its position x in the fleet: x % 3 + 1, x % 3, x % 5

>>> topology = Topology.fleet(2000, scale_sets=20, zones=3, availability_sets=2,
...                           availability_set_size=10)
>>> sum(1 for _ in topology.members())
2020
"""

from __future__ import annotations

import json
import re
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas import ConfigError as RelayConfigError
from schemas._files import read_setting_text

from ._errors import ConfigError, describe_validation_error

__all__ = [
    "AvailabilitySetSpec",
    "Membership",
    "ScaleSetSpec",
    "Topology",
    "implicit_membership",
    "load_topology",
    "standalone_membership",
]

_NAMESPACE = uuid.UUID("0b8e4f1e-5a43-4a51-b1d3-6f0f2f6c9a11")
_SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_SCALE_SET_VM = re.compile(r"^(?P<scale_set>[A-Za-z0-9][A-Za-z0-9._-]*)_(?P<instance>\d+)$")
_IMPLICIT_ZONES = ("1", "2", "3")
#: The most of a topology file read (a fleet of 10,000 VMs is about 1 MiB of JSON).
_MAX_TOPOLOGY_FILE = 16 << 20
_STANDALONE_FAULT_DOMAINS = 3
_STANDALONE_UPDATE_DOMAINS = 5


@dataclass(frozen=True, slots=True)
class Membership:
    """Where one VM sits. ``group`` names the VMs that see each other's events (None: alone)."""

    scale_set: str = ""
    instance_id: int | None = None
    placement_group_id: str = ""
    availability_set: str = ""
    zone: str = ""
    fault_domain: int = 0
    update_domain: int = 0

    @property
    def group(self) -> str | None:
        if self.placement_group_id:
            return f"placement-group:{self.placement_group_id}"
        if self.availability_set:
            return f"availability-set:{self.availability_set}"
        return None


class ScaleSetSpec(BaseModel):
    """A uniform scale set: VMs ``{name}_0`` .. ``{name}_{capacity-1}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=_SET_NAME)
    capacity: int = Field(ge=1, le=100_000)
    zones: tuple[str, ...] = Field(default=(), description="empty: a regional scale set")
    placement_group_size: int = Field(default=100, ge=1, le=1000)
    fault_domains: int = Field(default=5, ge=1, le=5)
    update_domains: int = Field(default=5, ge=1, le=20)

    @field_validator("zones")
    @classmethod
    def _distinct_zones(cls, zones: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(zones)) != len(zones) or not all(zones):
            raise ValueError("zones must be distinct, non-empty names")
        return zones

    def membership(self, instance: int) -> Membership:
        return _scale_set_member(
            self.name,
            instance,
            self.zones,
            self.placement_group_size,
            self.fault_domains,
            self.update_domains,
        )

    def members(self) -> Iterator[tuple[str, Membership]]:
        for instance in range(self.capacity):
            yield f"{self.name}_{instance}", self.membership(instance)


class AvailabilitySetSpec(BaseModel):
    """An availability set of plain VMs: ``vms`` by name, or ``size`` VMs ``{name}-0`` ..."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=_SET_NAME)
    size: int | None = Field(default=None, ge=1, le=1000)
    vms: tuple[str, ...] | None = Field(default=None, min_length=1)
    fault_domains: int = Field(default=2, ge=1, le=3)
    update_domains: int = Field(default=5, ge=1, le=20)

    @model_validator(mode="after")
    def _size_or_vms(self) -> Self:
        if (self.size is None) == (self.vms is None):
            raise ValueError("give either size or vms")
        return self

    def names(self) -> tuple[str, ...]:
        if self.vms is not None:
            return self.vms
        return tuple(f"{self.name}-{i}" for i in range(self.size or 0))

    def members(self) -> Iterator[tuple[str, Membership]]:
        for i, name in enumerate(self.names()):
            yield (
                name,
                Membership(
                    availability_set=self.name,
                    fault_domain=i % self.fault_domains,
                    update_domain=i % self.update_domains,
                ),
            )


class Topology(BaseModel):
    """A fleet layout: the body of ``POST /admin/topology`` and of ``--topology FILE``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scale_sets: tuple[ScaleSetSpec, ...] = ()
    availability_sets: tuple[AvailabilitySetSpec, ...] = ()
    vms: tuple[str, ...] = Field(default=(), description="standalone VMs, in no set")

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        for kind, names in (
            ("scale set", [s.name for s in self.scale_sets]),
            ("availability set", [a.name for a in self.availability_sets]),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{kind} {', '.join(map(repr, twice))} given twice")
        return self

    def members(self) -> Iterator[tuple[str, Membership | None]]:
        """Every VM with its membership, scale sets first; None for a standalone VM (whose zone
        and domains depend on its position in the fleet)."""
        for scale_set in self.scale_sets:
            yield from scale_set.members()
        for availability_set in self.availability_sets:
            yield from availability_set.members()
        for name in self.vms:
            yield name, None

    @classmethod
    def fleet(
        cls,
        scale_set_vms: int,
        *,
        scale_sets: int = 1,
        zones: int = 3,
        prefix: str = "fleet",
        placement_group_size: int = 100,
        availability_sets: int = 0,
        availability_set_size: int = 0,
        availability_set_prefix: str = "avset",
    ) -> Topology:
        """A generated fleet: ``scale_set_vms`` VMs split over ``scale_sets`` scale sets (named
        ``prefix``, or ``prefix-0`` .. when more than one) spanning ``zones`` zones (0: regional),
        plus ``availability_sets`` sets of ``availability_set_size`` plain VMs."""
        if scale_set_vms < 0 or scale_sets < 1 or zones < 0:
            raise ValueError("scale_set_vms >= 0, scale_sets >= 1 and zones >= 0, please")
        if availability_sets and availability_set_size < 1:
            raise ValueError("availability sets need availability_set_size >= 1")
        zone_names = tuple(str(z + 1) for z in range(zones))
        count = min(scale_sets, scale_set_vms)
        sets = []
        for k in range(count):
            capacity = scale_set_vms // count + (1 if k < scale_set_vms % count else 0)
            sets.append(
                ScaleSetSpec(
                    name=prefix if count == 1 else f"{prefix}-{k}",
                    capacity=capacity,
                    zones=zone_names,
                    placement_group_size=placement_group_size,
                    # Uniform zone-spanning scale sets take 1 (max spreading) or 5.
                    fault_domains=5,
                )
            )
        avsets = [
            AvailabilitySetSpec(name=f"{availability_set_prefix}-{a}", size=availability_set_size)
            for a in range(availability_sets)
        ]
        return cls(scale_sets=tuple(sets), availability_sets=tuple(avsets))


def _scale_set_member(
    scale_set: str,
    instance: int,
    zones: tuple[str, ...],
    group_size: int,
    fault_domains: int,
    update_domains: int,
) -> Membership:
    if zones:
        zone = zones[instance % len(zones)]
        group = instance // len(zones) // group_size
    else:
        zone, group = "", instance // group_size
    group_id = uuid.uuid5(_NAMESPACE, f"{scale_set}/{zone}/{group}")
    return Membership(
        scale_set=scale_set,
        instance_id=instance,
        placement_group_id=str(group_id),
        zone=zone,
        fault_domain=instance % fault_domains,
        update_domain=instance % update_domains,
    )


def implicit_membership(name: str, position: int) -> Membership:
    """The membership of a VM added by name alone, the ``position``-th (from 0) of the fleet."""
    match = _SCALE_SET_VM.match(name)
    if match is not None:
        return _scale_set_member(
            match["scale_set"], int(match["instance"]), _IMPLICIT_ZONES, 100, 5, 5
        )
    return standalone_membership(position)


def standalone_membership(position: int) -> Membership:
    """A VM in no set, the ``position``-th (from 0) of the fleet."""
    return Membership(
        zone=_IMPLICIT_ZONES[position % len(_IMPLICIT_ZONES)],
        fault_domain=position % _STANDALONE_FAULT_DOMAINS,
        update_domain=position % _STANDALONE_UPDATE_DOMAINS,
    )


def load_topology(path: str | Path) -> Topology:
    """A topology from a ``.json`` or ``.toml`` file (the shape of :class:`Topology`).

    Raises ConfigError naming the file and the bad field.
    """
    path = Path(path)
    try:
        text = read_setting_text(path, _MAX_TOPOLOGY_FILE, "the topology file")
    except RelayConfigError as exc:  # the simulator's own, which its command says in one line
        raise ConfigError(str(exc)) from exc
    document: Any
    try:
        if path.suffix == ".json":
            document = json.loads(text)
        elif path.suffix == ".toml":
            document = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: a topology file ends in .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from exc
    try:
        return Topology.model_validate(document)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe_validation_error(exc)}") from exc
