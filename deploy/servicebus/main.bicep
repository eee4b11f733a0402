// scheduled-events-relay on Azure Service Bus: the entities, managed identities, and role
// assignments scoped to single entities (never to the namespace), so each identity can do
// exactly its part:
//
//   identity   role                          scope
//   agents     Azure Service Bus Data Sender    topic scheduled-events
//   agents     Azure Service Bus Data Receiver  queue scheduled-events-approvals
//   approver   Azure Service Bus Data Receiver  subscription scheduled-events/approver
//   approver   Azure Service Bus Data Sender    queue scheduled-events-approvals
//   audit      Azure Service Bus Data Receiver  subscription scheduled-events/audit
//
// Local (SAS key) authentication is off: a connection string cannot bypass these roles.
// Deploy: az deployment group create -g RG -f deploy/servicebus/main.bicep -p namespaceName=NAME
// then attach the agents' identity to the VMs and scale sets (deploy/servicebus/roles.sh, or
// the `identity` block of your VM / VMSS templates). deploy/README.md explains what a stolen
// identity can and cannot do.

@description('The Service Bus namespace (Standard or Premium: sessions need it).')
param namespaceName string

param location string = resourceGroup().location

@allowed(['Standard', 'Premium'])
param sku string = 'Standard'

@description('User-assigned identities to create for the agents, e.g. one per scale set or VM group (a stolen one is revoked alone).')
param agentIdentityNames array = ['id-scheduled-events-agent']

@description('Principal (object) ids of existing identities that run agents, e.g. VMs\' system-assigned identities.')
param agentPrincipalIds array = []

param approverIdentityName string = 'id-scheduled-events-approver'
param auditIdentityName string = 'id-scheduled-events-audit'

// Built-in role definitions (the same ids in every tenant).
var dataSender = '69a216fc-b8fb-44d8-bc22-1f3c2cd27a39' // Azure Service Bus Data Sender
var dataReceiver = '4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0' // Azure Service Bus Data Receiver

// The contract's entity names (schemas/channels.py).
var topicName = 'scheduled-events'
var approvalsQueueName = 'scheduled-events-approvals'

resource ns 'Microsoft.ServiceBus/namespaces@2022-10-01-preview' = {
  name: namespaceName
  location: location
  sku: { name: sku, tier: sku }
  properties: {
    disableLocalAuth: true
    minimumTlsVersion: '1.2'
  }
}

resource topic 'Microsoft.ServiceBus/namespaces/topics@2022-10-01-preview' = {
  parent: ns
  name: topicName
  properties: { requiresDuplicateDetection: true, duplicateDetectionHistoryTimeWindow: 'PT10M' }
}

resource approverSubscription 'Microsoft.ServiceBus/namespaces/topics/subscriptions@2022-10-01-preview' = {
  parent: topic
  name: 'approver'
  properties: { maxDeliveryCount: 10, lockDuration: 'PT1M', requiresSession: true }
}

resource auditSubscription 'Microsoft.ServiceBus/namespaces/topics/subscriptions@2022-10-01-preview' = {
  parent: topic
  name: 'audit'
  properties: { maxDeliveryCount: 10, lockDuration: 'PT1M', requiresSession: false }
}

resource approvals 'Microsoft.ServiceBus/namespaces/queues@2022-10-01-preview' = {
  parent: ns
  name: approvalsQueueName
  properties: { requiresSession: true, defaultMessageTimeToLive: 'PT10M', lockDuration: 'PT1M' }
}

resource agentIdentities 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = [for name in agentIdentityNames: {
  name: name
  location: location
}]

resource approverIdentity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: approverIdentityName
  location: location
}

resource auditIdentity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: auditIdentityName
  location: location
}

// Agents: send lifecycle messages to the topic; receive approvals from the session queue. (Role
// assignment names must be known when the deployment starts: the identities' resource ids, not
// their principal ids, go into them.)
resource agentSends 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for (name, i) in agentIdentityNames: {
  name: guid(topic.id, agentIdentities[i].id, dataSender)
  scope: topic
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataSender)
    principalId: agentIdentities[i].properties.principalId
    principalType: 'ServicePrincipal'
  }
}]

resource agentReceives 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for (name, i) in agentIdentityNames: {
  name: guid(approvals.id, agentIdentities[i].id, dataReceiver)
  scope: approvals
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataReceiver)
    principalId: agentIdentities[i].properties.principalId
    principalType: 'ServicePrincipal'
  }
}]

resource existingAgentSends 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for principal in agentPrincipalIds: {
  name: guid(topic.id, principal, dataSender)
  scope: topic
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataSender)
    principalId: principal
    principalType: 'ServicePrincipal'
  }
}]

resource existingAgentReceives 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for principal in agentPrincipalIds: {
  name: guid(approvals.id, principal, dataReceiver)
  scope: approvals
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataReceiver)
    principalId: principal
    principalType: 'ServicePrincipal'
  }
}]

// The approver: the reverse. Read its subscription; send approvals.
resource approverReceives 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(approverSubscription.id, approverIdentity.id, dataReceiver)
  scope: approverSubscription
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataReceiver)
    principalId: approverIdentity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

resource approverSends 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(approvals.id, approverIdentity.id, dataSender)
  scope: approvals
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataSender)
    principalId: approverIdentity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The audit: read its subscription, nothing else.
resource auditReceives 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(auditSubscription.id, auditIdentity.id, dataReceiver)
  scope: auditSubscription
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', dataReceiver)
    principalId: auditIdentity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

output namespaceHost string = '${ns.name}.servicebus.windows.net'
output agentIdentityIds array = [for (name, i) in agentIdentityNames: agentIdentities[i].id]
output agentClientIds array = [for (name, i) in agentIdentityNames: agentIdentities[i].properties.clientId]
output approverClientId string = approverIdentity.properties.clientId
output auditClientId string = auditIdentity.properties.clientId
