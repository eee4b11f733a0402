"""The VM agent: watches IMDS Scheduled Events, publishes every transition, applies approvals."""
