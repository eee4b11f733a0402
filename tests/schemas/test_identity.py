"""A VM's identity from IMDS instance metadata: what a field of the wrong kind becomes."""

from __future__ import annotations

import pytest

from schemas import SchemaError
from schemas.identity import VmIdentity


def _compute(**fields: object) -> dict[str, object]:
    return {"compute": {"name": "web-7", **fields}}


def test_null_fields_are_empty_not_the_text_none() -> None:
    """``str(None)`` made the vmId "None", and the CloudEvents source of every message the
    text "None" when IMDS sent ``"resourceId": null``."""
    identity = VmIdentity.from_instance_metadata(
        _compute(vmId=None, resourceId=None, subscriptionId=None, location=None)
    )
    assert identity.vm_id == ""
    assert identity.resource_id == ""
    assert identity.source == "urn:vm:web-7"


def test_a_list_or_an_object_is_no_text_and_costs_only_its_field() -> None:
    """A scale set name or zone of the wrong kind refused the whole identity: the agent could
    not start. Now that field is left out, and the rest is used."""
    identity = VmIdentity.from_instance_metadata(
        _compute(
            vmId=["x"],
            resourceId={"a": 1},
            vmScaleSetName=["web"],
            zone={"z": 1},
            platformFaultDomain=2,
        )
    )
    assert identity.vm_id == ""
    assert identity.resource_id == ""
    assert identity.scale_set is None
    assert identity.zone is None
    assert identity.fault_domain == 2


@pytest.mark.parametrize("name", [None, "", ["web-7"], {"n": 1}])
def test_a_name_that_is_no_text_is_no_identity(name: object) -> None:
    with pytest.raises(SchemaError, match=r"compute\.name"):
        VmIdentity.from_instance_metadata({"compute": {"name": name}})
