"""The Service Bus recipe (deploy/servicebus): role assignments scoped to single entities, the
right built-in roles, SAS keys off, the contract's entity names; the az script parses.

Checked as text: the Bicep CLI cannot be installed here (it ships on NuGet and GitHub, neither
reachable from this machine), so ``az bicep build`` is for the operator's CI."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from schemas.channels import DEFAULT_CHANNELS

from ._paths import SERVICEBUS

BICEP = (SERVICEBUS / "main.bicep").read_text()
ROLES = SERVICEBUS / "roles.sh"
#: Azure's built-in role definition ids (the same in every tenant).
DATA_SENDER = "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39"
DATA_RECEIVER = "4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0"


def _assignments() -> dict[str, tuple[str, str]]:
    """resource symbol -> (role variable, scope symbol)"""
    found = {}
    for block in re.finditer(
        r"^resource (\w+) 'Microsoft\.Authorization/roleAssignments@[^']+' = (.*?)^}\]?$",
        BICEP,
        re.MULTILINE | re.DOTALL,
    ):
        body = block.group(2)
        scope = re.search(r"^\s*scope: (\w+)$", body, re.MULTILINE)
        role = re.search(r"roleDefinitions', (\w+)\)", body)
        assert scope, block.group(1)
        assert role, block.group(1)
        found[block.group(1)] = (role.group(1), scope.group(1))
    return found


def test_each_identity_gets_exactly_its_roles_on_single_entities():
    assert _assignments() == {
        "agentSends": ("dataSender", "topic"),
        "agentReceives": ("dataReceiver", "approvals"),
        "existingAgentSends": ("dataSender", "topic"),
        "existingAgentReceives": ("dataReceiver", "approvals"),
        "approverReceives": ("dataReceiver", "approverSubscription"),
        "approverSends": ("dataSender", "approvals"),
        "auditReceives": ("dataReceiver", "auditSubscription"),
    }


def test_the_roles_are_azures_built_in_data_sender_and_receiver():
    assert f"var dataSender = '{DATA_SENDER}'" in BICEP
    assert f"var dataReceiver = '{DATA_RECEIVER}'" in BICEP
    assert "090c5cfd-751d-490a-894a-3ce6f1109419" not in BICEP  # never Data Owner


def test_no_key_can_bypass_the_roles():
    assert "disableLocalAuth: true" in BICEP
    assert "--disable-local-auth true" in ROLES.read_text()


def test_the_entities_are_the_contracts():
    assert f"var topicName = '{DEFAULT_CHANNELS.events_topic}'" in BICEP
    assert f"var approvalsQueueName = '{DEFAULT_CHANNELS.approvals_queue}'" in BICEP
    # The approver's subscription is session-enabled (one active approver at a time).
    approver = re.search(r"name: 'approver'\n\s+properties: \{([^}]*)\}", BICEP)
    assert approver
    assert "requiresSession: true" in approver.group(1)


def test_the_az_script_grants_the_same_and_parses():
    script = ROLES.read_text()
    grants = re.findall(r'^grant "\$(\w+)" "\$(\w+)" "([^"]+)"$', script, re.MULTILINE)
    assert sorted(grants) == sorted(
        [
            ("SENDER", "agent_principal", "$topic"),
            ("RECEIVER", "agent_principal", "$approvals"),
            ("RECEIVER", "approver_principal", "$topic/subscriptions/approver"),
            ("SENDER", "approver_principal", "$approvals"),
            ("RECEIVER", "audit_principal", "$topic/subscriptions/audit"),
        ]
    )
    assert DATA_SENDER in script
    assert DATA_RECEIVER in script
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    result = subprocess.run([bash, "-n", str(ROLES)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
