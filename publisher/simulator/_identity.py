"""Who a simulated VM is: the ``compute`` section of ``/metadata/instance``.

Everything is derived from the VM's name and its position in the fleet, so the same name always
gets the same vmId, and a fleet started twice looks the same. A name of the form
``{scale-set}_{instance}`` (as Azure names scale-set VMs) makes a scale-set VM.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_SUBSCRIPTION_ID", "Placement", "VmIdentity", "identity_for"]

DEFAULT_SUBSCRIPTION_ID = "8c56d827-5f07-45ce-8f2b-6c5001db5c6f"
_NAMESPACE = uuid.UUID("6f3e4c1a-9d1b-4b53-9a55-2d7c8f0e1b42")
_SCALE_SET_NAME = re.compile(r"^(?P<scale_set>[A-Za-z0-9][A-Za-z0-9._-]*)_(?P<instance>\d+)$")
_FAULT_DOMAINS = 3
_SCALE_SET_FAULT_DOMAINS = 5
_UPDATE_DOMAINS = 5
_ZONES = 3


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
    platform_fault_domain: int
    platform_update_domain: int
    resource_id: str
    private_ip: str

    def compute(self) -> dict[str, Any]:
        """The ``compute`` section, shaped like Azure's (domains are strings there too)."""
        return {
            "azEnvironment": "AzurePublicCloud",
            "location": self.location,
            "name": self.name,
            "offer": "0001-com-ubuntu-server-jammy",
            "osType": "Linux",
            "platformFaultDomain": str(self.platform_fault_domain),
            "platformUpdateDomain": str(self.platform_update_domain),
            "priority": "Regular",
            "provider": "Microsoft.Compute",
            "publisher": "Canonical",
            "resourceGroupName": self.resource_group,
            "resourceId": self.resource_id,
            "sku": "22_04-lts-gen2",
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


def identity_for(name: str, index: int, placement: Placement) -> VmIdentity:
    """The identity of the VM called ``name``, the ``index``-th (from 0) added to the fleet.

    A scale-set VM (``web_3``) takes its domains and zone from its instance number; any other VM
    from its index.

    >>> identity_for("web_7", 0, Placement()).vm_scale_set_name
    'web'
    """
    sub, rg = placement.subscription_id, placement.resource_group
    match = _SCALE_SET_NAME.match(name)
    if match is not None:
        scale_set, instance = match["scale_set"], int(match["instance"])
        position = instance
        fault_domain = instance % _SCALE_SET_FAULT_DOMAINS
        resource_id = (
            f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute"
            f"/virtualMachineScaleSets/{scale_set}/virtualMachines/{instance}"
        )
    else:
        scale_set, position = "", index
        fault_domain = index % _FAULT_DOMAINS
        resource_id = (
            f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute"
            f"/virtualMachines/{name}"
        )
    return VmIdentity(
        name=name,
        vm_id=str(uuid.uuid5(_NAMESPACE, name)),
        subscription_id=sub,
        resource_group=rg,
        location=placement.location,
        zone=str(position % _ZONES + 1),
        vm_scale_set_name=scale_set,
        platform_fault_domain=fault_domain,
        platform_update_domain=position % _UPDATE_DOMAINS,
        resource_id=resource_id,
        private_ip=f"10.0.{index // 250 % 256}.{index % 250 + 4}",
    )
