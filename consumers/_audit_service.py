"""The audit service: consumer group ``audit`` appends every lifecycle message to the ledger,
as received, messages of a newer minor version's types included.

A message is acked only once it is stored; appends are idempotent, so audit processes may run
side by side on one group (the broker shares the messages) and a redelivery is harmless. A
message whose origin is not the VM it describes, or that says something else under an id
already recorded, is dead-lettered with its reason instead (``origin-mismatch``,
``id-conflict``) and counted.
"""

from __future__ import annotations

import logging

from schemas import LifecycleMessage, NewerMessage
from schemas.origin import OriginVerifier
from schemas.transport import Transport

from ._audit import Appended, Ledger
from ._origin import Origin
from ._stream import DeadLetterReason, FleetStream, Rejected

__all__ = ["AuditService"]

log = logging.getLogger(__name__)


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
            transport, group, origin=origin, verifier=verifier, newer=self.handle
        )
        self.stream.add_handler(self.handle)
        self.appended = 0
        self.conflicts = 0

    async def handle(self, message: LifecycleMessage | NewerMessage) -> None:
        delivery = self.stream.current_delivery
        sender = None if delivery is None else delivery.sender
        result = await self.ledger.append(message, sender=sender)
        if result is Appended.NEW:
            self.appended += 1
        elif result is Appended.CONFLICT:
            self.conflicts += 1
            log.error(
                "audit: message %s says something else than the message recorded under the "
                "same id: not recorded, dead-lettered (id-conflict)",
                message.id,
            )
            raise Rejected(
                DeadLetterReason.ID_CONFLICT.value,
                f"the ledger holds other content under id {message.id}",
            )

    async def run(self) -> None:
        log.info("audit: reading group %s", self.stream.group)
        await self.stream.run()

    def stop(self) -> None:
        self.stream.stop()
