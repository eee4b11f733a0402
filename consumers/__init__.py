"""The central side: the fleet-wide stream, the fleet view, policies, approvals and audit."""
