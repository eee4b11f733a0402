"""The console's engine: the fleet as the approver knows it, kept live from the broker, and the
operators' actions (approve, hold, release), each recorded in the audit.

At start it subscribes to a transient copy of the stream first (so nothing published meanwhile
is missed), then loads the approver's durable state (:meth:`ApproverState.load`: the open
events, each agent's last message, the approvals sent) and the latest decision of each event
from the ledger; the stream then keeps the view live (a message applied twice changes nothing).
The approver's decisions and the holds are not broker messages: they are read from the shared
database every ``poll_interval`` seconds (new ``ledger_decisions`` rows by position).

>>> async with open_database(url) as db:                                  # doctest: +SKIP
...     console = ConsoleService(transport, db, signing_key=key)
...     async with asyncio.TaskGroup() as tasks:
...         tasks.create_task(console.run())
...         await console.ready.wait()
...         await console.approve(session, event_id, version=..., reason="patched")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas import LifecycleMessage, RelayError, TransportError
from schemas.origin import OriginVerifier
from schemas.transport import Transport

from .._approvals import ApprovalSender, NoApprovalTarget
from .._approver_state import ApproverState, PlannedDecision
from .._audit import Ledger, LedgerEntry
from .._db import Database, as_time, placeholders
from .._fleet import EventPhase, EventState, FleetView, SentApproval
from .._origin import Origin
from .._stream import FleetStream
from ._feed import Feed
from ._live import CONSOLE_POLICY, LatestDecision, LiveFleet
from ._sessions import Session

__all__ = ["ActionRefused", "ActionResult", "ConsoleService", "running"]

log = logging.getLogger(__name__)

#: PostgreSQL may commit a lower position after a higher one: read this far back each time.
_LOOKBACK = {"sqlite": 0, "postgres": 200}
_BATCH = 2000


class ActionRefused(RelayError):
    """An action the console will not do, with the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ActionResult:
    message: str
    approval_id: str | None = None
    target: str | None = None


class ConsoleService:
    """See the module docstring. ``signing_key`` None: a console that cannot approve."""

    def __init__(
        self,
        transport: Transport,
        db: Database,
        *,
        signing_key: Ed25519PrivateKey | None,
        group: str = "console",
        approver_group: str = "approver",
        origin: Origin | None = None,
        verifier: OriginVerifier | None = None,
        poll_interval: float = 0.5,
        batch_interval: float = 0.25,
        fleet: FleetView | None = None,
    ) -> None:
        self.db = db
        self.live = LiveFleet(fleet)
        self.state = ApproverState(db, approver_group, writer=f"console:{group}")
        self.ledger = Ledger(db)
        self.sender = (
            None
            if signing_key is None
            else ApprovalSender(transport, signing_key, fleet=self.live.fleet)
        )
        self.stream = FleetStream(
            transport, group, transient=True, origin=origin, verifier=verifier
        )
        self.stream.add_handler(self._on_message)
        self.poll_interval = poll_interval
        self.feed = Feed(
            self.live,
            interval=batch_interval,
            liveness=self.live.fleet.liveness_timeout.total_seconds(),
        )
        self.ready = asyncio.Event()
        self._cursor = 0
        self._stopping = asyncio.Event()

    @property
    def can_approve(self) -> bool:
        return self.sender is not None

    # ------------------------------------------------------------------------------ running

    async def run(self) -> None:
        """Until :meth:`stop` or cancellation."""
        await self.stream.open()
        try:
            await self.state.load(self.live.fleet)
            await self._load_decisions()
            self.live.set_holds(await self.state.holds())
            self.live.changed_all()
            self.live.take_changes()  # pages start from a snapshot
            log.info(
                "console: %d open events and %d agents loaded from the approver's state",
                sum(1 for _ in self.live.fleet.events(open_only=True)),
                sum(1 for _ in self.live.fleet.agents()),
            )
            self.ready.set()
            async with asyncio.TaskGroup() as tasks:
                workers = [
                    tasks.create_task(self.stream.run()),
                    tasks.create_task(self.feed.run()),
                    tasks.create_task(self._poll()),
                    tasks.create_task(self._prune()),
                ]
                await self._stopping.wait()
                self.stream.stop()
                for worker in workers:
                    worker.cancel()
        finally:
            await self.stream.close(handled=True)

    def stop(self) -> None:
        self._stopping.set()

    async def _on_message(self, message: LifecycleMessage) -> None:
        self.live.apply(message)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self._new_decisions()
                self.live.set_holds(await self.state.holds())
            except (TransportError, RelayError) as exc:
                log.warning("console: reading decisions and holds failed (%s); retrying", exc)

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.live.prune()

    # ---------------------------------------------------------------------------- decisions

    async def _load_decisions(self) -> None:
        row = await self.db.fetchone("SELECT max(position) FROM ledger_decisions")
        top = int(row[0]) if row is not None and row[0] is not None else 0
        ids = [state.event_id for state in self.live.fleet.events()]
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            rows = await self.db.fetch(
                "SELECT position, time, event_id, body FROM ledger_decisions "
                f"WHERE event_id IN ({placeholders(len(chunk))}) AND position <= ? "
                "ORDER BY position",
                *chunk,
                top,
            )
            self._take(rows)
        self._cursor = top

    async def _new_decisions(self) -> None:
        lookback = _LOOKBACK.get(self.db.dialect, 0)
        while True:
            rows = await self.db.fetch(
                "SELECT position, time, event_id, body FROM ledger_decisions "
                f"WHERE position > ? ORDER BY position LIMIT {_BATCH}",
                max(0, self._cursor - lookback),
            )
            self._take(rows)
            if rows:
                self._cursor = max(self._cursor, max(int(r[0]) for r in rows))
            if len(rows) < _BATCH:
                return

    def _take(self, rows: list[tuple[object, ...]]) -> None:
        for position, at, event_id, body in rows:
            decision = LatestDecision.from_row(int(str(position)), as_time(at), body)
            self.live.decided(str(event_id), decision)

    # ------------------------------------------------------------------------------ actions

    def _open_event(self, event_id: str) -> EventState:
        state = self.live.fleet.event(event_id)
        if state is None:
            raise ActionRefused(
                404, f"event {event_id} is not known here (never seen, or over and forgotten)"
            )
        return state

    async def approve(
        self,
        session: Session,
        event_id: str,
        *,
        version: str,
        reason: str,
        vm: str | None = None,
    ) -> ActionResult:
        """Sign and send an approval of ``event_id`` bound to ``version`` (the one the operator
        saw); refused (409) when the event is no longer at that version."""
        if self.sender is None:
            raise ActionRefused(
                503, "this console has no signing key (--signing-key): it cannot approve"
            )
        state = self._open_event(event_id)
        if state.version != version:
            raise ActionRefused(
                409,
                f"the event changed: look again (you saw version {version}, it is now "
                f"{state.version})",
            )
        if state.phase is not EventPhase.SCHEDULED:
            raise ActionRefused(
                409, f"the event is {state.phase.value}: only a Scheduled event can be approved"
            )
        operator = session.operator_name
        why = reason.strip() or "approved from the console"
        try:
            approval, address = self.sender.prepare(
                event_id, vm or None, event_version=version, reason=why, decided_by=operator
            )
        except NoApprovalTarget as exc:
            raise ActionRefused(409, str(exc)) from exc
        await self.ledger.append_decision(
            event_id,
            "approve",
            why,
            decided_by=operator,
            policy=CONSOLE_POLICY,
            target=approval.vm,
            event_type=state.event_type,
            event_version=version,
            approval_id=approval.approval_id,
        )
        try:
            await self.sender.send(approval, address)
        except TransportError as exc:
            log.error(
                "console: %s approved %s (version %s) but it could not be sent to %s: %s",
                operator,
                event_id,
                version,
                approval.vm,
                exc,
            )
            await self.ledger.append_decision(
                event_id,
                "approve-failed",
                f"not delivered to {approval.vm}: {exc}",
                decided_by=operator,
                policy=CONSOLE_POLICY,
                target=approval.vm,
                event_type=state.event_type,
                event_version=version,
                approval_id=approval.approval_id,
            )
            raise ActionRefused(502, f"the approval could not be sent: {exc}") from exc
        state.sent = SentApproval(approval.approval_id, version, approval.vm, datetime.now(UTC))
        self.live.fleet.refresh(state)
        self.live.changed_event(event_id)
        log.info(
            "console: %s approved %s (%s, version %s), sent to %s: %s",
            operator,
            event_id,
            state.event_type,
            version,
            approval.vm,
            why,
        )
        return ActionResult(
            f"approval of {event_id} sent to {approval.vm}", approval.approval_id, approval.vm
        )

    async def hold(self, session: Session, event_id: str, *, reason: str) -> ActionResult:
        """The automatic approver leaves the event to NotBefore until it is released."""
        state = self._open_event(event_id)
        if state.phase.is_over:
            raise ActionRefused(409, f"the event is {state.phase.value}: nothing to hold")
        operator = session.operator_name
        why = reason.strip() or "held from the console"
        await self.state.hold(
            _operator_record(event_id, "hold", why, operator, state.event_type, state.version)
        )
        self.live.set_holds(await self.state.holds())
        log.info("console: %s holds %s (%s): %s", operator, event_id, state.event_type, why)
        note = (
            " (an approval of this version was sent already: it stands)"
            if state.approval_pending
            else ""
        )
        return ActionResult(f"{event_id} is held: the approver leaves it to NotBefore{note}")

    async def release(self, session: Session, event_id: str, *, reason: str) -> ActionResult:
        operator = session.operator_name
        state = self.live.fleet.event(event_id)
        why = reason.strip() or "released from the console"
        record = _operator_record(
            event_id,
            "release",
            why,
            operator,
            None if state is None else state.event_type,
            None if state is None else state.version,
        )
        if not await self.state.release(record):
            raise ActionRefused(409, f"event {event_id} is not held")
        self.live.set_holds(await self.state.holds())
        log.info("console: %s released %s: %s", operator, event_id, why)
        return ActionResult(f"{event_id} is released: the approver decides on it again")

    # ------------------------------------------------------------------------------ history

    async def search(
        self,
        *,
        vm: str | None = None,
        event_id: str | None = None,
        event_type: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 500,
    ) -> list[LedgerEntry]:
        return await self.ledger.search(
            vm=vm, event_id=event_id, event_type=event_type, since=since, until=until, limit=limit
        )

    async def timeline(self, event_id: str) -> list[LedgerEntry]:
        return await self.ledger.history(event_id=event_id)


@contextlib.asynccontextmanager
async def running(console: ConsoleService) -> AsyncIterator[ConsoleService]:
    """Run ``console`` as a task until the block exits (loaded and live inside it)."""
    task = asyncio.create_task(console.run(), name="console")
    try:
        async with asyncio.timeout(60):
            while not console.ready.is_set():
                if task.done():
                    task.result()
                    raise RuntimeError("the console stopped while starting")
                await asyncio.sleep(0.01)
        yield console
    finally:
        console.stop()
        try:
            await asyncio.wait_for(task, timeout=10)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _operator_record(
    event_id: str,
    action: str,
    reason: str,
    operator: str,
    event_type: str | None,
    event_version: str | None,
) -> PlannedDecision:
    """An operator's hold or release, for the ledger (stored with the change of the holds)."""
    return PlannedDecision(
        event_id=event_id,
        event_type=event_type,
        action=action,
        reason=reason,
        policy=CONSOLE_POLICY,
        decided_by=operator,
        event_version=event_version,
        at=datetime.now(UTC),
    )
