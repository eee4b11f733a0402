"""The audit service: consumer group ``audit`` appends every lifecycle message to the ledger,
as received, messages of a newer minor version's types included.

A message is acked only once it is stored; appends are idempotent, so audit processes may run
side by side on one group (the broker shares the messages) and a redelivery is harmless. A
message whose origin is not the VM it describes, or that says something else under an id
already recorded, is dead-lettered with its reason instead (``origin-mismatch``,
``id-conflict``) and counted.

What the stream handles is stored once per ack batch (the stream's ``before_ack``: group
commit), in one INSERT for up to 256 messages, not one commit per message. A message that
contradicts the ledger is found in that INSERT, after its batch was handled: the batch is then
not acked, and when the broker delivers it again, each message that may be recorded already (a
redelivery, or one found contradicting) is compared with the ledger before it is accepted, so
the contradicting one is dead-lettered and the others are acked.

The audit is on no decision's way, so a batch waits for more a while (``LINGER``) once there is
nothing more to read: a wave reaches the audit a few messages at a time, and each few was a
commit of its own, on the CPU the approver beside it needed (in a 10,000-VM wave on one machine,
8,075 commits). The ledger is then up to ``LINGER`` behind the stream; a stop commits and acks
what is handled first.
"""

from __future__ import annotations

import logging

from schemas import LifecycleMessage, NewerMessage, RelayError
from schemas.origin import OriginVerifier
from schemas.transport import Transport

from ._audit import Appended, Ledger
from ._origin import Origin
from ._stream import DeadLetterReason, FleetStream, Rejected, message_key

__all__ = ["AuditService"]

log = logging.getLogger(__name__)

#: Seconds a batch waits for more once the stream has nothing more to read (the approver's
#: stream: 0.02, its decisions' approvals go out after the commit).
LINGER = 0.25


class LedgerConflict(RelayError):
    """Messages of a batch say something else than the ledger holds under their ids: the batch
    is not acked, and those messages are dead-lettered when they come back."""


class AuditService:
    def __init__(
        self,
        transport: Transport,
        ledger: Ledger,
        *,
        group: str = "audit",
        origin: Origin | None = None,
        verifier: OriginVerifier | None = None,
    ) -> None:
        self.ledger = ledger
        self.stream = FleetStream(
            transport,
            group,
            origin=origin,
            verifier=verifier,
            newer=self.handle,
            before_ack=self.commit,
            ack_interval=LINGER,
        )
        self.stream.add_handler(self.handle)
        self.appended = 0
        self.conflicts = 0
        #: Handled, to be stored before their batch is acked.
        self._pending: list[tuple[LifecycleMessage | NewerMessage, str | None]] = []
        #: (VM, id) of messages found contradicting the ledger in a batch then not acked.
        self._contradicting: set[tuple[str, str]] = set()

    async def handle(self, message: LifecycleMessage | NewerMessage) -> None:
        delivery = self.stream.current_delivery
        sender = None if delivery is None else delivery.sender
        redelivered = delivery is not None and delivery.delivery_count > 0
        key = message_key(message)
        if redelivered or key in self._contradicting:
            # It may be recorded already: compare it with the ledger now, alone.
            self._contradicting.discard(key)
            result = await self.ledger.recorded(message)
            if result is Appended.DUPLICATE:
                return
            if result is Appended.CONFLICT:
                self.conflicts += 1
                log.error(
                    "audit: message %s says something else than the message recorded under "
                    "the same id: not recorded, dead-lettered (id-conflict)",
                    message.id,
                )
                raise Rejected(
                    DeadLetterReason.ID_CONFLICT.value,
                    f"the ledger holds other content under id {message.id}",
                )
        self._pending.append((message, sender))

    async def commit(self) -> None:
        """Store what was handled since the last commit (before the stream acks it)."""
        batch, self._pending = self._pending, []
        if not batch:
            return
        results = await self.ledger.append_many(batch)
        self.appended += results.count(Appended.NEW)
        contradicting = [
            message
            for (message, _), result in zip(batch, results, strict=True)
            if result is Appended.CONFLICT
        ]
        if contradicting:
            self._contradicting.update(message_key(m) for m in contradicting)
            raise LedgerConflict(
                f"{len(contradicting)} message(s) of this batch say something else than the "
                f"ledger holds under their ids ({', '.join(m.id for m in contradicting[:5])}): "
                "the batch is not acked; when the broker delivers it again they are dead-lettered "
                "(id-conflict) and the rest acked (recorded already)"
            )

    async def run(self) -> None:
        log.info("audit: reading group %s", self.stream.group)
        await self.stream.run()

    def stop(self) -> None:
        self.stream.stop()
