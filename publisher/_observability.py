"""Everything the agent counts, on the project's own small Prometheus registry
(:mod:`schemas.observability`: no prometheus-client, a few hundred KiB less per VM).

Each :class:`Metrics` has its own registry, so several agents in one process (the demo, the fleet
benchmark) do not clash. ``/metrics`` and ``/healthz`` are served by
:class:`schemas.observability.HealthServer` on ``--metrics-port``.
"""

from __future__ import annotations

from schemas.observability import Registry

__all__ = ["Metrics"]


class Metrics:
    """Everything the agent counts."""

    def __init__(self) -> None:
        self.registry = r = Registry()
        self.polls = r.counter("agent_imds_polls", "Scheduled Events GETs answered")
        self.imds_requests = r.counter(
            "agent_imds_requests", "IMDS requests made, of every kind", ["endpoint"]
        )
        self.imds_errors = r.counter(
            "agent_imds_errors", "IMDS requests that failed, by kind", ["kind"]
        )
        self.stale_documents = r.counter(
            "agent_imds_stale_documents",
            "Documents older than the last one trusted, held back instead of diffed",
        )
        self.unreadable_events = r.counter(
            "agent_imds_unreadable_events",
            "Events IMDS listed that could not be read (a field missing or invalid), each counted "
            "once while listed: the answer's other events are published, and it is held at its "
            "last readable state",
        )
        self.unreadable_listed = r.gauge(
            "agent_imds_unreadable_events_listed",
            "Events that could not be read in the last IMDS answer taken",
        )
        self.transitions = r.counter(
            "agent_transitions", "Transitions published, by kind", ["kind"]
        )
        self.published = r.counter(
            "agent_messages_published", "Messages confirmed by the broker", ["kind"]
        )
        self.publish_failures = r.counter(
            "agent_publish_failures", "Publish attempts the broker did not confirm"
        )
        self.publish_latency = r.histogram(
            "agent_publish_latency_seconds",
            "From entering the outbox to the broker's confirm",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.outbox_depth = r.gauge("agent_outbox_depth", "Messages waiting for a confirm")
        self.outbox_dropped = r.counter(
            "agent_outbox_dropped", "Heartbeats dropped because the outbox was full"
        )
        self.outbox_set_aside = r.gauge(
            "agent_outbox_set_aside",
            "Messages that can never be sent (unreadable, or refused by the broker for good), "
            "kept in the state store",
        )
        self.approvals_applied = r.counter(
            "agent_approvals_applied", "Approvals POSTed to IMDS (or verified, in a dry run)"
        )
        self.approvals_rejected = r.counter(
            "agent_approvals_rejected", "Approvals refused, by reason", ["reason"]
        )
        self.hooks = r.counter("agent_hooks", "Hook runs, by outcome", ["result"])
        self.last_poll = r.gauge(
            "agent_last_successful_poll_timestamp", "Unix time of the last good poll"
        )

    def exposition(self) -> bytes:
        return self.registry.exposition()
