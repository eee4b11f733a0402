"""The agent: IMDS in, lifecycle messages out, approvals back in.

One :class:`asyncio.TaskGroup` holds the parts: the broker connection, the outbox publisher
(:mod:`._outbox`), the watcher that polls IMDS and commits transitions (:mod:`._watch`), the
approvals consumer (:mod:`._approvals`), the heartbeat, the hooks (:mod:`._hooks`) and the
metrics server. ``stop()`` (or SIGTERM/SIGINT in CLI mode) stops polling and approvals, queues
``agent.offline``, drains the outbox within ``drain_timeout`` and returns; what could not be
sent stays in the state store for the next run. A part that fails ends the agent: the others
are cancelled until they end, as at a stop, and ``run()`` raises the failure (for systemd to
start it again), never hangs.

``/healthz`` tells the truth: 503, with the reason, once the broker has been unreachable or
IMDS failing for longer than ``health_grace``; the live outbox depth, the age of its oldest
message, and the messages set aside (never sendable) are in every answer.

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
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

from schemas import (
    AgentData,
    AgentMessage,
    ConfigError,
    ImdsError,
    MessageType,
    ReplyAddress,
    TransportError,
    VmIdentity,
    load_public_keys,
)
from schemas._backoff import Backoff, FailingSpell
from schemas.observability import HealthServer
from schemas.transport import Transport, open_transport, redact

from ._approvals import ApprovalHandler
from ._hooks import HookRunner
from ._imds import ImdsClient, with_retries
from ._observability import Metrics
from ._origin import KEY_FILE, OriginSigner, load_origin_key
from ._outbox import OutboxPublisher
from ._poller import Cadence, RequestLimiter
from ._settings import AgentSettings
from ._state import StateStore, StoredState
from ._watch import IMDS_BACKOFF_CAP, Watcher

__all__ = ["AGENT_VERSION", "Agent"]

log = logging.getLogger(__name__)

T = TypeVar("T")

try:
    AGENT_VERSION = importlib.metadata.version("scheduled-events-relay")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    AGENT_VERSION = "0.0.0+unknown"

#: How often an approvals consumer that keeps failing to open is said again at WARNING.
_FAILING_REMINDER = 300.0
#: How long the approvals consumer stays open after the last approvable event went.
_LISTEN_LINGER = 30.0
#: How long a stopping task may take to end after its cancel before it is warned about: a
#: broker exchange it finishes first (a channel's close) has a timeout of 5 s.
_STOP_PATIENCE = 6.0


def _scope(settings: AgentSettings, vm: str) -> str:
    return "all" if settings.all_events else f"vm:{vm.casefold()}"


class Agent:
    """One VM's agent. ``await agent.run()`` until :meth:`stop`.

    ``ready`` is set once the agent knows its identity, is connected to the broker, listens for
    its approvals (when it listens all the time) and has polled IMDS once. ``identity`` and
    ``metrics_port`` are known from then.

    ``transport``: one to use instead of opening its own (many agents may share one
    connection, as the fleet benchmark does); the agent closes it when it stops unless
    ``close_transport`` is False (then whoever shares it closes it). ``state_executor``: the
    single-thread executor its state store runs SQLite on, shared by the agents of one process
    (by default the store has a thread of its own).
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        transport: Transport | None = None,
        close_transport: bool = True,
        state_executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.ready = asyncio.Event()
        self.identity: VmIdentity | None = None
        self.metrics_port: int | None = None
        #: Names this run of the agent (agent messages' ids derive from it).
        self.instance = uuid.uuid4().hex
        self._transport = transport
        self._close_transport = close_transport or transport is None
        self._state_executor = state_executor
        self._stop = asyncio.Event()
        self._stop_reason = "stopped"
        self._connected = asyncio.Event()
        self._subscribed = asyncio.Event()
        self._started_at = time.monotonic()
        self._depth = 0
        self._watcher: Watcher | None = None
        self._outbox: OutboxPublisher | None = None
        self._approvals_failing = FailingSpell(_FAILING_REMINDER)
        #: Every IMDS request goes through it (its ``peak``: the most in any one second).
        self.limiter = RequestLimiter(settings.imds_max_rps)

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
        """(healthy, details) for ``/healthz``; unhealthy with ``reasons`` once the broker or
        IMDS has been failing longer than ``health_grace``."""
        now = time.monotonic()
        grace = self.settings.health_grace
        watcher, outbox = self._watcher, self._outbox
        reasons: list[str] = []
        last_poll = (
            None if watcher is None or watcher.last_poll is None else now - watcher.last_poll
        )
        if watcher is not None and watcher.failing_since is not None:
            failing = now - watcher.failing_since
            if failing > grace:
                reasons.append(f"IMDS failing for {failing:.0f} s: {watcher.last_error}")
        elif last_poll is None and now - self._started_at > grace:
            reasons.append(f"IMDS not answered since the start, {now - self._started_at:.0f} s ago")
        down_since = [
            since
            for since in (
                None if self._connected.is_set() else self._started_at,
                None if outbox is None else outbox.failing_since,
                None if outbox is None else outbox.stalled_since,
                self._approvals_failing.since,
            )
            if since is not None
        ]
        broker_down = now - min(down_since) if down_since else None
        if broker_down is not None and broker_down > grace:
            why = outbox.last_error if outbox is not None and outbox.last_error else "no link"
            reasons.append(f"broker unreachable for {broker_down:.0f} s: {why}")
        depth = outbox.depth if outbox is not None else self._depth
        oldest = None if outbox is None or outbox.oldest is None else time.time() - outbox.oldest
        set_aside = 0 if outbox is None else outbox.set_aside
        if set_aside:
            reasons.append(
                f"{set_aside} message(s) could not be sent and are set aside in the state store"
            )
        details: dict[str, object] = {
            "vm": self.identity.name if self.identity else None,
            "last_poll_seconds_ago": None if last_poll is None else round(last_poll, 3),
            "broker_connected": self._connected.is_set()
            and (broker_down is None or broker_down <= grace),
            "outbox_depth": depth,
            "outbox_oldest_seconds": None if oldest is None else round(max(oldest, 0.0), 3),
            "outbox_set_aside": set_aside,
            "reasons": reasons,
        }
        unhealthy = [r for r in reasons if "set aside" not in r]
        return not unhealthy, details

    # ---------------------------------------------------------------------------------- run

    async def run(self, *, handle_signals: bool = False) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals``)."""
        settings = self.settings
        trusted = load_public_keys(settings.trust_keys)
        loop = asyncio.get_running_loop()
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self.stop, signal.Signals(signum).name)
        store = await StateStore.open(
            settings.state_dir, limit=settings.outbox_limit, executor=self._state_executor
        )
        limiter = self.limiter
        imds = ImdsClient(
            settings.imds_url,
            api_version=settings.api_version,
            instance_api_version=settings.instance_api_version,
            timeout=settings.imds_timeout,
            first_timeout=settings.imds_first_timeout,
            max_body=settings.imds_max_body,
            limiter=limiter,
            on_request=lambda endpoint: self.metrics.imds_requests.labels(endpoint).inc(),
        )
        transport = self._transport or open_transport(
            settings.broker, settings.channels, name=f"scheduled-events-agent {self.instance[:8]}"
        )
        server: HealthServer | None = None
        try:
            if settings.metrics_port is not None:
                server = HealthServer(
                    self.metrics.registry,
                    self.health,
                    host=settings.metrics_host,
                    port=settings.metrics_port,
                )
                await server.start()
                self.metrics_port = server.port
            identity = await self._until_stopped(self._identity(imds))
            if identity is None:
                return
            self.identity = identity
            # Before anything of the store is used (outbox, document, intents, hook runs,
            # sequence): a store another VM left here (a golden image, a copied disk) is
            # moved aside, and this VM starts a store of its own. That VM's origin key goes
            # with it: a key every VM of an image shares is no VM's own (any of them could
            # sign as another whose attestation of that key it has seen).
            await store.claim(identity, with_files=(KEY_FILE,))
            await self._serve(identity, store, imds, transport, trusted)
        finally:
            if handle_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)
            if server is not None:
                await server.close()
            await imds.aclose()
            try:
                if self._close_transport:
                    await asyncio.wait_for(transport.close(), 5)
            except (TransportError, TimeoutError) as exc:
                log.warning("closing the broker connection failed (%r); exiting anyway", exc)
            await store.close()

    async def _identity(self, imds: ImdsClient) -> VmIdentity:
        try:
            return await with_retries(
                imds.identity,
                what="GET instance metadata",
                backoff=Backoff(0.5, IMDS_BACKOFF_CAP),
                on_error=lambda exc: self.metrics.imds_errors.labels(exc.kind).inc(),
            )
        except ImdsError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                # Asked the wrong thing, or the wrong place: waiting will not change it.
                raise ConfigError(f"imds_url: {exc}") from exc
            raise

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

    async def _serve(
        self,
        identity: VmIdentity,
        store: StateStore,
        imds: ImdsClient,
        transport: Transport,
        trusted: dict[str, Any],
    ) -> None:
        settings = self.settings
        reply_to = transport.reply_address(identity.name)
        stored = await store.load()
        scope = _scope(settings, identity.name)
        log.info(
            "agent %s for VM %s (%s); broker %s; %d message(s) left in the outbox; state %s; "
            "settings %s",
            AGENT_VERSION,
            identity.name,
            identity.source,
            redact(settings.broker),
            stored.depth,
            store.path or "in memory",
            settings.summary(),
        )
        signer = OriginSigner(load_origin_key(settings.state_dir), imds) if settings.signs else None
        outbox = self._outbox = OutboxPublisher(
            store,
            transport,
            self.metrics,
            publish_timeout=settings.publish_timeout,
            connected=self._connected,
            sign=None if signer is None else signer.properties,
            signing_ready=None if signer is None else signer.ready,
        )
        cadence = Cadence(
            settings.poll_interval,
            settings.fast_poll_interval,
            settings.fast_poll_seconds,
            settings.not_before_lead_seconds,
        )
        hooks = HookRunner(
            timeout=settings.hook_timeout,
            identity=identity,
            reply_to=reply_to,
            store=store,
            metrics=self.metrics,
            committed=outbox.notify,
            rerun_interrupted=settings.hook_rerun_interrupted,
            hooks=settings.hooks,
        )
        watcher = self._watcher = self._watch(
            identity, reply_to, imds, store, outbox, hooks, cadence, scope, stored
        )
        approvals = ApprovalHandler(
            settings,
            identity=identity,
            reply_to=reply_to,
            imds=imds,
            document=watcher.document_since,
            store=store,
            metrics=self.metrics,
            trusted=trusted,
            epoch=stored.epoch,
            store_created=stored.created,
            committed=outbox.notify,
            on_applied=cadence.boost,
        )
        await self._commit_agent_message(
            store, MessageType.AGENT_ONLINE, identity, reply_to, settings=settings.summary()
        )
        async with asyncio.TaskGroup() as tg:
            connector = tg.create_task(self._connect(transport), name="agent-connect")
            publisher = tg.create_task(outbox.run(), name="agent-outbox")
            workers = [
                tg.create_task(watcher.run(), name="agent-watch"),
                tg.create_task(
                    self._consume_approvals(transport, identity, approvals, watcher),
                    name="agent-approvals",
                ),
                tg.create_task(
                    self._heartbeat(store, identity, reply_to, outbox), name="agent-heartbeat"
                ),
                tg.create_task(hooks.run(), name="agent-hooks"),
                tg.create_task(self._announce_ready(watcher), name="agent-ready"),
            ]
            if signer is not None:
                workers.append(tg.create_task(signer.run(), name="agent-origin"))
            try:
                await self._stop.wait()
                await _cancel_all(workers)
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
                await _cancel_all([publisher, connector])
            except asyncio.CancelledError:
                # A part failed (the group cancels the others, and this, once) or run() itself
                # was cancelled. The group then waits for every task: one that lost its cancel
                # (a library that turns it into a link error, retried) would hold it, and run(),
                # for ever, neither working nor exiting for a supervisor to restart. Cancelled
                # until they end, as at a stop; then the failure goes on out of run().
                tasks = [connector, publisher, *workers]
                for task in tasks:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        log.error(
                            "%s failed (%r): stopping the other parts; the agent exits",
                            task.get_name(),
                            task.exception(),
                        )
                await _cancel_all(tasks)
                raise

    def _watch(
        self,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        imds: ImdsClient,
        store: StateStore,
        outbox: OutboxPublisher,
        hooks: HookRunner,
        cadence: Cadence,
        scope: str,
        stored: StoredState,
    ) -> Watcher:
        previous = stored.document
        if previous is not None and stored.scope not in (None, "all", scope):
            # The last run published only its own VM's events; this one publishes more: events
            # of other VMs it never announced are new to the stream.
            own = (stored.scope or "").removeprefix("vm:")
            events = tuple(e for e in previous.events if e.affects(own))
            previous = previous.model_copy(update={"events": events})
        return Watcher(
            self.settings,
            identity=identity,
            reply_to=reply_to,
            imds=imds,
            store=store,
            metrics=self.metrics,
            outbox=outbox,
            hooks=hooks,
            cadence=cadence,
            scope=scope,
            stored_scope=stored.scope if stored.document is not None else None,
            previous=previous,
            revisions=stored.revisions,
            on_depth=self._note_depth,
        )

    async def _announce_ready(self, watcher: Watcher) -> None:
        await self._connected.wait()
        if self.settings.listens_always:
            await self._subscribed.wait()
        await watcher.polled.wait()
        self.ready.set()
        log.info("agent ready")

    async def _connect(self, transport: Transport) -> None:
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                await asyncio.wait_for(transport.connect(), self.settings.publish_timeout)
            except ConfigError:
                raise  # refused for good (credentials, an entity declared otherwise): stop
            except (TransportError, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("broker not reachable (%s); trying again in %.2f s", exc, delay)
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
        document = None if self._watcher is None else self._watcher.document
        data = AgentData(
            vm=identity,
            agent_version=AGENT_VERSION,
            reply_to=reply_to,
            settings=settings or {},
            uptime_seconds=round(time.monotonic() - self._started_at, 3),
            outbox_depth=self._outbox.depth if self._outbox is not None else self._depth,
            document_incarnation=None if document is None else document.document_incarnation,
            reason=reason,
            heartbeat_interval=self.settings.heartbeat_interval,
        )
        message = AgentMessage.build(
            kind, data, observed_at=datetime.now(UTC), instance=self.instance
        )
        result = await store.commit([message])
        self._note_depth(result.depth, result.dropped)

    def _note_depth(self, depth: int, dropped: int = 0) -> None:
        self._depth = depth
        if self._outbox is not None:
            self._outbox.depth = depth
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
        """An ``agent.heartbeat`` once ``heartbeat_interval`` went by with no message queued.
        Any message says the agent is alive (consumers count a VM live from its last message
        of any kind, :meth:`consumers.FleetView.is_live`), so a VM busy with its events sends
        none: in a fleet-wide wave, heartbeats would otherwise add a message a minute per VM
        to every consumer group when they have the most to read (AMQP's own heartbeats go
        only on an idle connection for the same reason)."""
        interval = self.settings.heartbeat_interval
        while True:
            quiet = time.monotonic() - store.last_queued
            if quiet < interval:
                await asyncio.sleep(interval - quiet)
                continue
            await self._commit_agent_message(store, MessageType.AGENT_HEARTBEAT, identity, reply_to)
            outbox.notify()

    async def _consume_approvals(
        self,
        transport: Transport,
        identity: VmIdentity,
        handler: ApprovalHandler,
        watcher: Watcher,
    ) -> None:
        await self._connected.wait()
        await handler.reconcile_all()
        always = self.settings.listens_always
        backoff = Backoff(0.2, 5.0)
        failing = self._approvals_failing
        while True:
            if not always:
                await watcher.approvable.wait()
            try:
                async with transport.approvals(identity.name) as subscription:
                    self._subscribed.set()
                    lasted = failing.ended()
                    if lasted is not None:
                        log.info(
                            "approvals consumer open again after %.1f s of failed tries", lasted
                        )
                    backoff.reset()
                    await self._listen(subscription, handler, watcher, always)
            except TransportError as exc:
                if _cancelling():  # a cancel that came back as a link error: still a cancel
                    raise asyncio.CancelledError from exc
                delay = backoff.next()
                # Said once, then every _FAILING_REMINDER while it lasts: a line at every try
                # would be a dozen a minute from each VM, thousands from a fleet.
                said = failing.failed()
                if said == "first":
                    log.warning(
                        "approvals consumer could not be opened or was lost (%s); trying again "
                        "in %.2f s, then less and less often (at most every %.0f s) for as long "
                        "as it fails; said again when it is back",
                        exc,
                        delay,
                        backoff.cap,
                    )
                elif said == "reminder":
                    log.warning(
                        "approvals consumer still failing after %.0f s (%s); no approval reaches "
                        "this VM meanwhile",
                        failing.lasted,
                        exc,
                    )
                else:
                    log.debug(
                        "approvals consumer still failing (%s); next try in %.2f s", exc, delay
                    )
                await asyncio.sleep(delay)

    async def _listen(
        self, subscription: Any, handler: ApprovalHandler, watcher: Watcher, always: bool
    ) -> None:
        """Handle approvals; when not listening always, return once no event of this VM has
        been approvable for a while (the subscription, and its link, close)."""
        iterator = aiter(subscription)
        while True:
            if always:
                delivery = await anext(iterator)
            else:
                try:
                    async with asyncio.timeout(_LISTEN_LINGER):
                        delivery = await anext(iterator)
                except TimeoutError:
                    if not watcher.approvable.is_set():
                        log.debug("no approvable event: approvals consumer closed")
                        return
                    continue
            await handler.handle(delivery)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _cancel_all(tasks: list[asyncio.Task[Any]], *, patience: float = _STOP_PATIENCE) -> None:
    """Cancel the tasks and wait for them; one that swallows its cancel (a library that turns
    it into another error, which a retry loop then takes for a lost link) is cancelled again
    each second, and named, so a stop never hangs on it. Within ``patience`` a task still
    running is most likely waiting for an exchange with the broker that a cancel does not cut
    (closing its channel: :func:`~schemas.transport._amqp_errors.uninterrupted`, bounded by its
    own timeouts; the next cancel ends the wait, not the exchange), so it is said at INFO;
    after, as a warning."""
    pending = {task for task in tasks if not task.done()}
    began = time.monotonic()
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
        waited = time.monotonic() - began
        for task in pending:
            if waited < patience:
                log.info(
                    "%s still stopping %.0f s after its cancel (finishing an exchange with the "
                    "broker?): cancelling it again",
                    task.get_name(),
                    waited,
                )
            else:
                log.warning(
                    "%s did not stop %.0f s after its cancel: cancelling it again",
                    task.get_name(),
                    waited,
                )
