"""The audit service: consumer group ``audit`` appends every lifecycle message to the ledger.
A message is acked only once it is stored; appends are idempotent, so audit processes may run
side by side on one group (the broker shares the messages) and a redelivery is harmless."""

from __future__ import annotations

import logging

from schemas import LifecycleMessage
from schemas.transport import Transport

from ._audit import Ledger
from ._stream import FleetStream

__all__ = ["AuditService"]

log = logging.getLogger(__name__)


class AuditService:
    def __init__(self, transport: Transport, ledger: Ledger, *, group: str = "audit") -> None:
        self.ledger = ledger
        self.stream = FleetStream(transport, group)
        self.stream.add_handler(self.handle)
        self.appended = 0

    async def handle(self, message: LifecycleMessage) -> None:
        if await self.ledger.append(message):
            self.appended += 1

    async def run(self) -> None:
        log.info("audit: reading group %s", self.stream.group)
        await self.stream.run()

    def stop(self) -> None:
        self.stream.stop()
