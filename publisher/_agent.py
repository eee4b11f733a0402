"""The agent: IMDS in, lifecycle messages out, approvals back in.

One :class:`asyncio.TaskGroup` holds the parts: the broker connection, the outbox publisher, the
poller, the approvals consumer, the heartbeat, the hooks and the metrics server. ``stop()`` (or
SIGTERM/SIGINT in CLI mode) stops polling and approvals, queues ``agent.offline``, drains the
outbox within ``drain_timeout`` and returns; what could not be sent stays in the state store for
the next run.

>>> agent = Agent(AgentSettings(imds_url="http://127.0.0.1:8080/vm/web-7",
...                             broker="memory://demo", state_dir=None))   # doctest: +SKIP
>>> task = asyncio.create_task(agent.run())                                # doctest: +SKIP
>>> await agent.started(timeout=10)                                        # doctest: +SKIP
>>> agent.stop(); await task                                               # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Mapping
from datetime import UTC, datetime
from typing import TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from schemas import (
    AgentData,
    AgentMessage,
    ImdsError,
    MessageType,
    ReplyAddress,
    ScheduledEventsDocument,
    TransitionMessage,
    TransportError,
    VmIdentity,
    diff,
    load_public_keys,
)
from schemas.transport import Transport, open_transport, redact

from ._approvals import ApprovalHandler
from ._backoff import Backoff
from ._hooks import HookRunner
from ._imds import ImdsClient, with_retries
from ._observability import Metrics, MetricsServer
from ._outbox import OutboxPublisher
from ._poller import Cadence, RequestLimiter
from ._settings import AgentSettings
from ._state import StateStore

__all__ = ["AGENT_VERSION", "Agent"]

log = logging.getLogger(__name__)

T = TypeVar("T")

try:
    AGENT_VERSION = importlib.metadata.version("scheduled-events-relay")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    AGENT_VERSION = "0.0.0+unknown"

#: The longest pause between polls while IMDS keeps failing.
_IMDS_BACKOFF_CAP = 8.0


def _scope(settings: AgentSettings, vm: str) -> str:
    return "all" if settings.all_events else f"vm:{vm.casefold()}"


def _restricted(document: ScheduledEventsDocument, vm: str) -> ScheduledEventsDocument:
    """The document as a run that published only ``vm``'s events saw it."""
    events = tuple(e for e in document.events if e.affects(vm))
    return document.model_copy(update={"events": events})


class Agent:
    """One VM's agent. ``await agent.run()`` until :meth:`stop`.

    ``ready`` is set once the agent knows its identity, is connected to the broker, consumes its
    approvals and has polled IMDS once. ``identity`` and ``metrics_port`` are known from then.
    """

    def __init__(self, settings: AgentSettings, *, transport: Transport | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.ready = asyncio.Event()
        self.identity: VmIdentity | None = None
        self.metrics_port: int | None = None
        #: Names this run of the agent (agent messages' ids derive from it).
        self.instance = uuid.uuid4().hex
        self._transport = transport
        self._stop = asyncio.Event()
        self._stop_reason = "stopped"
        self._connected = asyncio.Event()
        self._subscribed = asyncio.Event()
        self._polled = asyncio.Event()
        self._started_at = time.monotonic()
        self._last_poll: float | None = None
        self._document: ScheduledEventsDocument | None = None
        self._depth = 0

    # ------------------------------------------------------------------------------ control

    def stop(self, reason: str = "stopped") -> None:
        """Ask the agent to stop: it drains the outbox, says ``agent.offline`` and returns."""
        if not self._stop.is_set():
            log.info("stopping: %s", reason)
            self._stop_reason = reason
            self._stop.set()

    async def started(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until :attr:`ready` (TimeoutError after ``timeout`` seconds)."""
        async with asyncio.timeout(timeout):
            await self.ready.wait()

    def health(self) -> tuple[bool, dict[str, object]]:
        age = None if self._last_poll is None else time.monotonic() - self._last_poll
        stale_after = max(10 * self.settings.poll_interval, 30.0)
        healthy = age is not None and age <= stale_after and self._connected.is_set()
        return healthy, {
            "vm": self.identity.name if self.identity else None,
            "last_poll_seconds_ago": None if age is None else round(age, 3),
            "broker_connected": self._connected.is_set(),
            "outbox_depth": self._depth,
        }

    # ---------------------------------------------------------------------------------- run

    async def run(self, *, handle_signals: bool = False) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals``)."""
        settings = self.settings
        trusted = load_public_keys(settings.trust_keys)
        loop = asyncio.get_running_loop()
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self.stop, signal.Signals(signum).name)
        store = await StateStore.open(settings.state_dir, limit=settings.outbox_limit)
        limiter = RequestLimiter(settings.imds_max_rps)
        imds = ImdsClient(
            settings.imds_url,
            api_version=settings.api_version,
            instance_api_version=settings.instance_api_version,
            timeout=settings.imds_timeout,
            first_timeout=settings.imds_first_timeout,
            limiter=limiter,
        )
        transport = self._transport or open_transport(settings.broker, settings.channels)
        server: MetricsServer | None = None
        try:
            if settings.metrics_port is not None:
                server = MetricsServer(
                    self.metrics,
                    self.health,
                    host=settings.metrics_host,
                    port=settings.metrics_port,
                )
                await server.start()
                self.metrics_port = server.port
            identity = await self._until_stopped(
                with_retries(
                    imds.identity,
                    what="GET instance metadata",
                    backoff=Backoff(0.5, _IMDS_BACKOFF_CAP),
                    on_error=self._count_imds_error,
                )
            )
            if identity is None:
                return
            self.identity = identity
            await self._serve(identity, store, imds, transport, trusted)
        finally:
            if handle_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)
            if server is not None:
                await server.close()
            await imds.aclose()
            try:
                await asyncio.wait_for(transport.close(), 5)
            except (TransportError, TimeoutError) as exc:
                log.warning("closing the broker connection failed (%r); exiting anyway", exc)
            await store.close()

    async def _until_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None when stop() comes first (then ``work`` is cancelled)."""
        task = asyncio.ensure_future(work)
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            return None
        return task.result()

    def _count_imds_error(self, exc: ImdsError) -> None:
        self.metrics.imds_errors.labels(exc.kind).inc()

    async def _serve(
        self,
        identity: VmIdentity,
        store: StateStore,
        imds: ImdsClient,
        transport: Transport,
        trusted: Mapping[str, Ed25519PublicKey],
    ) -> None:
        settings = self.settings
        reply_to = transport.reply_address(identity.name)
        stored = await store.load()
        scope = _scope(settings, identity.name)
        previous = stored.document
        if previous is not None and stored.scope not in (None, "all", scope):
            # The last run published only its own VM's events; this one publishes more: events
            # of other VMs it never announced are new to the stream.
            previous = _restricted(previous, (stored.scope or "").removeprefix("vm:"))
        log.info(
            "agent %s for VM %s (%s); broker %s; %d message(s) left in the outbox; settings %s",
            AGENT_VERSION,
            identity.name,
            identity.source,
            redact(settings.broker),
            stored.depth,
            settings.summary(),
        )
        outbox = OutboxPublisher(
            store,
            transport,
            self.metrics,
            publish_timeout=settings.publish_timeout,
            connected=self._connected,
        )
        cadence = Cadence(
            settings.poll_interval,
            settings.fast_poll_interval,
            settings.fast_poll_seconds,
            settings.not_before_lead_seconds,
        )

        def committed() -> None:
            outbox.notify()

        hooks = HookRunner(
            settings.hooks,
            timeout=settings.hook_timeout,
            identity=identity,
            reply_to=reply_to,
            store=store,
            metrics=self.metrics,
            committed=committed,
        )
        approvals = ApprovalHandler(
            settings,
            identity=identity,
            reply_to=reply_to,
            imds=imds,
            store=store,
            metrics=self.metrics,
            trusted=trusted,
            committed=committed,
            on_applied=cadence.wake,
        )
        await self._commit_agent_message(
            store, MessageType.AGENT_ONLINE, identity, reply_to, settings=settings.summary()
        )
        async with asyncio.TaskGroup() as tg:
            connector = tg.create_task(self._connect(transport), name="agent-connect")
            publisher = tg.create_task(outbox.run(), name="agent-outbox")
            workers = [
                tg.create_task(
                    self._poll(
                        store, imds, identity, reply_to, scope, previous, cadence, hooks, outbox
                    ),
                    name="agent-poll",
                ),
                tg.create_task(
                    self._consume_approvals(transport, identity, approvals), name="agent-approvals"
                ),
                tg.create_task(
                    self._heartbeat(store, identity, reply_to, outbox), name="agent-heartbeat"
                ),
                tg.create_task(hooks.run(), name="agent-hooks"),
                tg.create_task(self._announce_ready(), name="agent-ready"),
            ]
            await self._stop.wait()
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await self._commit_agent_message(
                store, MessageType.AGENT_OFFLINE, identity, reply_to, reason=self._stop_reason
            )
            outbox.notify()
            drained = await outbox.drain(settings.drain_timeout)
            if drained:
                log.info("outbox drained; offline")
            else:
                log.warning(
                    "outbox not drained within %.1f s: %d message(s) kept for the next start",
                    settings.drain_timeout,
                    await store.depth(),
                )
            publisher.cancel()
            connector.cancel()

    async def _announce_ready(self) -> None:
        await self._connected.wait()
        await self._subscribed.wait()
        await self._polled.wait()
        self.ready.set()
        log.info("agent ready")

    async def _connect(self, transport: Transport) -> None:
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                await asyncio.wait_for(transport.connect(), self.settings.publish_timeout)
            except (TransportError, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("broker not reachable (%r); trying again in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                continue
            log.info("connected to %s", redact(self.settings.broker))
            self._connected.set()
            return

    async def _commit_agent_message(
        self,
        store: StateStore,
        kind: MessageType,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        *,
        settings: dict[str, object] | None = None,
        reason: str | None = None,
    ) -> None:
        document = self._document
        data = AgentData(
            vm=identity,
            agent_version=AGENT_VERSION,
            reply_to=reply_to,
            settings=settings or {},
            uptime_seconds=round(time.monotonic() - self._started_at, 3),
            outbox_depth=self._depth,
            document_incarnation=None if document is None else document.document_incarnation,
            reason=reason,
        )
        message = AgentMessage.build(
            kind, data, observed_at=datetime.now(UTC), instance=self.instance
        )
        result = await store.commit([message])
        self._note_depth(result.depth, result.dropped)

    def _note_depth(self, depth: int, dropped: int = 0) -> None:
        self._depth = depth
        self.metrics.outbox_depth.set(depth)
        if dropped:
            self.metrics.outbox_dropped.inc(dropped)

    async def _heartbeat(
        self,
        store: StateStore,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        outbox: OutboxPublisher,
    ) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            await self._commit_agent_message(store, MessageType.AGENT_HEARTBEAT, identity, reply_to)
            outbox.notify()

    async def _consume_approvals(
        self, transport: Transport, identity: VmIdentity, handler: ApprovalHandler
    ) -> None:
        await self._connected.wait()
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                async with transport.approvals(identity.name) as subscription:
                    self._subscribed.set()
                    backoff.reset()
                    async for delivery in subscription:
                        await handler.handle(delivery)
            except TransportError as exc:
                delay = backoff.next()
                log.warning("approvals consumer lost (%r); reopening in %.2f s", exc, delay)
                await asyncio.sleep(delay)

    async def _poll(
        self,
        store: StateStore,
        imds: ImdsClient,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        scope: str,
        previous: ScheduledEventsDocument | None,
        cadence: Cadence,
        hooks: HookRunner,
        outbox: OutboxPublisher,
    ) -> None:
        settings = self.settings
        backoff = Backoff(settings.poll_interval, max(_IMDS_BACKOFF_CAP, settings.poll_interval))
        vm = identity.name
        stored_scope: str | None = None if previous is None else scope
        while True:
            began = time.monotonic()
            try:
                document = await imds.scheduled_events()
            except ImdsError as exc:
                self._count_imds_error(exc)
                delay = backoff.next()
                log.warning("IMDS poll failed (%s); next try in %.2f s", exc, delay)
                await cadence.sleep(delay)
                continue
            backoff.reset()
            self.metrics.polls.inc()
            self.metrics.last_poll.set(time.time())
            self._last_poll = time.monotonic()
            if document is not previous:
                transitions = diff(previous, document)
                chosen = [t for t in transitions if settings.all_events or t.event.affects(vm)]
                now = datetime.now(UTC)
                messages = [
                    TransitionMessage.build(t, vm=identity, reply_to=reply_to, observed_at=now)
                    for t in chosen
                ]
                result = await store.commit(
                    messages,
                    document=document,
                    scope=scope if stored_scope != scope else None,
                )
                stored_scope = scope
                self._note_depth(result.depth, result.dropped)
                previous = self._document = document
                for transition, row in zip(chosen, result.rows, strict=True):
                    self.metrics.transitions.labels(transition.kind.value).inc()
                    log.info(
                        "%s %s %s (incarnation %d) -> outbox seq %d",
                        transition.kind.value,
                        transition.event.event_type,
                        transition.event.event_id,
                        transition.incarnation,
                        row.sequence,
                    )
                    hooks.submit(transition, row.body)
                if messages:
                    outbox.notify()
                if transitions:
                    cadence.boost()
            self._polled.set()
            watched = (
                document.events
                if settings.all_events
                else tuple(e for e in document.events if e.affects(vm))
            )
            due = began + cadence.next_interval(watched)
            await cadence.sleep(due - time.monotonic())
