"""Who a VM is, from ``/metadata/instance``: the name that appears in ``Resources`` and the rest."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._errors import SchemaError

__all__ = ["MAX_KEY_LENGTH", "VmIdentity"]


#: The longest name the contract takes where a name is a key: a VM's name, an EventId, a message
#: or approval id. Azure's names and ids are far shorter (a GUID is 36); the
#: bound keeps every key a database indexes within PostgreSQL's index entry (about 2.7 KB, and
#: a character may take 4 bytes), so one hostile message cannot make a batch unstorable.
MAX_KEY_LENGTH = 200


def _as_int(value: object) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


def _text(value: object) -> str:
    """A text field of the compute section: absent or null is empty (``str(None)`` made a VM's
    vmId, and its CloudEvents source, the text "None"); a number is its digits; a list or an
    object is not a text, and is left empty rather than written out as Python's repr."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return ""


class VmIdentity(BaseModel):
    """A VM's identity. ``name`` is the compute name, as IMDS lists it in ``Resources``
    (for a scale-set VM ``{scale-set}_{instance-id}``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    vm_id: str = ""
    resource_id: str = ""
    subscription_id: str = ""
    resource_group: str = ""
    location: str = ""
    scale_set: str | None = None
    zone: str | None = None
    fault_domain: int | None = None
    update_domain: int | None = None

    @classmethod
    def from_instance_metadata(cls, document: object) -> VmIdentity:
        """Build from the JSON of ``GET /metadata/instance`` (its ``compute`` section)."""
        compute: Any = document.get("compute") if isinstance(document, dict) else None
        if not isinstance(compute, dict) or not _text(compute.get("name")):
            raise SchemaError("the instance metadata has no compute.name")
        try:
            return cls(
                name=_text(compute["name"]),
                vm_id=_text(compute.get("vmId")),
                resource_id=_text(compute.get("resourceId")),
                subscription_id=_text(compute.get("subscriptionId")),
                resource_group=_text(compute.get("resourceGroupName")),
                location=_text(compute.get("location")),
                scale_set=_text(compute.get("vmScaleSetName")) or None,
                zone=_text(compute.get("zone")) or None,
                fault_domain=_as_int(compute.get("platformFaultDomain")),
                update_domain=_as_int(compute.get("platformUpdateDomain")),
            )
        except ValidationError as exc:
            raise SchemaError(f"the instance metadata is not usable: {exc}") from exc

    @property
    def source(self) -> str:
        """The CloudEvents ``source``: the Azure resource ID, or a URN when it is unknown."""
        return self.resource_id or f"urn:vm:{self.name}"
