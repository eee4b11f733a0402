#!/usr/bin/env bash
# The same role assignments as main.bicep with the az CLI, for a namespace and entities that
# exist already (README.md, "Azure Service Bus", creates them), plus the managed identities on
# the VMs. Every scope is one entity, never the namespace.
#
#   RG=relay-rg NAMESPACE=relay-sb AGENT_SCALE_SETS="web db" AGENT_VMS="jump-1" \
#     bash deploy/servicebus/roles.sh
#
# Then on each VM the agent runs with --broker-file holding `sb://NAMESPACE` and
# AZURE_CLIENT_ID=<the agents' identity client id> in /etc/scheduled-events/agent.env
# (DefaultAzureCredential picks that user-assigned identity from IMDS).
set -euo pipefail

: "${RG:?the resource group}" "${NAMESPACE:?the Service Bus namespace}"
AGENT_IDENTITY=${AGENT_IDENTITY:-id-scheduled-events-agent}
APPROVER_IDENTITY=${APPROVER_IDENTITY:-id-scheduled-events-approver}
AUDIT_IDENTITY=${AUDIT_IDENTITY:-id-scheduled-events-audit}
SENDER="Azure Service Bus Data Sender"      # 69a216fc-b8fb-44d8-bc22-1f3c2cd27a39
RECEIVER="Azure Service Bus Data Receiver"  # 4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0

ns_id=$(az servicebus namespace show -g "$RG" -n "$NAMESPACE" --query id -o tsv)
topic="$ns_id/topics/scheduled-events"
approvals="$ns_id/queues/scheduled-events-approvals"

# No SAS keys: only Entra ID identities, each limited by its roles.
az servicebus namespace update -g "$RG" -n "$NAMESPACE" --disable-local-auth true -o none

identity() {  # create (idempotent) a user-assigned identity; print "principalId id clientId"
  az identity create -g "$RG" -n "$1" --query "[principalId, id, clientId]" -o tsv | tr '\n' ' '
}

grant() {  # role, principal, scope
  az role assignment create --role "$1" --assignee-object-id "$2" \
    --assignee-principal-type ServicePrincipal --scope "$3" -o none
}

read -r agent_principal agent_id agent_client < <(identity "$AGENT_IDENTITY")
read -r approver_principal _ approver_client < <(identity "$APPROVER_IDENTITY")
read -r audit_principal _ audit_client < <(identity "$AUDIT_IDENTITY")

grant "$SENDER" "$agent_principal" "$topic"
grant "$RECEIVER" "$agent_principal" "$approvals"
grant "$RECEIVER" "$approver_principal" "$topic/subscriptions/approver"
grant "$SENDER" "$approver_principal" "$approvals"
grant "$RECEIVER" "$audit_principal" "$topic/subscriptions/audit"

# The agents' identity on the VMs that run them.
for scale_set in ${AGENT_SCALE_SETS:-}; do
  az vmss identity assign -g "$RG" -n "$scale_set" --identities "$agent_id" -o none
  az vmss update-instances -g "$RG" -n "$scale_set" --instance-ids '*' -o none
done
for vm in ${AGENT_VMS:-}; do
  az vm identity assign -g "$RG" -n "$vm" --identities "$agent_id" -o none
done

echo "agents:   AZURE_CLIENT_ID=$agent_client"
echo "approver: AZURE_CLIENT_ID=$approver_client"
echo "audit:    AZURE_CLIENT_ID=$audit_client"
