"""Who a simulated VM is: the ``compute`` section of ``/metadata/instance``.

Everything is derived from the VM's name, its position in the fleet and its membership (see
:mod:`._topology`), so the same name always gets the same vmId, and a fleet started twice (or
served by several shards) looks the same.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ._topology import Membership

__all__ = ["DEFAULT_SUBSCRIPTION_ID", "Placement", "VmIdentity", "identity_for"]

DEFAULT_SUBSCRIPTION_ID = "8c56d827-5f07-45ce-8f2b-6c5001db5c6f"
_NAMESPACE = uuid.UUID("6f3e4c1a-9d1b-4b53-9a55-2d7c8f0e1b42")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the fleet lives: the same for every VM of one simulator."""

    subscription_id: str = DEFAULT_SUBSCRIPTION_ID
    resource_group: str = "relay-sim-rg"
    location: str = "westeurope"


@dataclass(frozen=True, slots=True)
class VmIdentity:
    """One VM's identity, as instance metadata tells it."""

    name: str
    vm_id: str
    subscription_id: str
    resource_group: str
    location: str
    zone: str
    vm_scale_set_name: str
    placement_group_id: str
    availability_set: str
    platform_fault_domain: int
    platform_update_domain: int
    resource_id: str
    private_ip: str
    sku: str = "22_04-lts-gen2"
    license_type: str = ""  # Azure Hybrid Benefit: none here

    def compute(self) -> dict[str, Any]:
        """The ``compute`` section, shaped like Azure's: domains are strings there too, and an
        inapplicable value is an empty string (``placementGroupId`` outside a scale set). Azure
        does not show the availability set here; the admin API does."""
        return {
            "azEnvironment": "AzurePublicCloud",
            "location": self.location,
            "name": self.name,
            "offer": "0001-com-ubuntu-server-jammy",
            "osType": "Linux",
            "platformFaultDomain": str(self.platform_fault_domain),
            "placementGroupId": self.placement_group_id,
            "plan": {"name": "", "product": "", "publisher": ""},
            "platformUpdateDomain": str(self.platform_update_domain),
            "priority": "Regular",
            "provider": "Microsoft.Compute",
            "publisher": "Canonical",
            "resourceGroupName": self.resource_group,
            "resourceId": self.resource_id,
            "sku": self.sku,
            "subscriptionId": self.subscription_id,
            "tags": "",
            "version": "22.04.202404100",
            "vmId": self.vm_id,
            "vmScaleSetName": self.vm_scale_set_name,
            "vmSize": "Standard_D2s_v5",
            "zone": self.zone,
        }

    def network(self) -> dict[str, Any]:
        """A one-NIC ``network`` section with a private address derived from the index."""
        return {
            "interface": [
                {
                    "ipv4": {
                        "ipAddress": [{"privateIpAddress": self.private_ip, "publicIpAddress": ""}],
                        "subnet": [{"address": "10.0.0.0", "prefix": "16"}],
                    },
                    "ipv6": {"ipAddress": []},
                    "macAddress": self.vm_id.replace("-", "")[:12].upper(),
                }
            ]
        }


def identity_for(name: str, index: int, placement: Placement, membership: Membership) -> VmIdentity:
    """The identity of the VM called ``name``, the ``index``-th (from 0) added to the fleet,
    sitting where ``membership`` says (see :mod:`._topology`).

    >>> from ._topology import implicit_membership
    >>> identity_for("web_7", 0, Placement(), implicit_membership("web_7", 0)).vm_scale_set_name
    'web'
    """
    sub, rg = placement.subscription_id, placement.resource_group
    provider = f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute"
    if membership.scale_set:
        resource_id = (
            f"{provider}/virtualMachineScaleSets/{membership.scale_set}"
            f"/virtualMachines/{membership.instance_id}"
        )
    else:
        resource_id = f"{provider}/virtualMachines/{name}"
    return VmIdentity(
        name=name,
        vm_id=str(uuid.uuid5(_NAMESPACE, name)),
        subscription_id=sub,
        resource_group=rg,
        location=placement.location,
        zone=membership.zone,
        vm_scale_set_name=membership.scale_set,
        placement_group_id=membership.placement_group_id,
        availability_set=membership.availability_set,
        platform_fault_domain=membership.fault_domain,
        platform_update_domain=membership.update_domain,
        resource_id=resource_id,
        private_ip=f"10.0.{index // 250 % 256}.{index % 250 + 4}",
    )
