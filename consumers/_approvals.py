"""Approvals out: a signed approval sent to one VM's reply address.

One approval is enough for an event: Azure starts it for every VM in ``Resources``. So by
default the target is the first *live* VM in ``Resources`` (its agent will apply it), and the
reply address is that VM's own by the transport's convention (never one a message names).
Sending twice is harmless: the agent applies the first, and IMDS answers 200 for an event
approved already.

>>> sender = ApprovalSender(transport, load_signing_key(path), fleet=view)  # doctest: +SKIP
>>> await sender.approve("EVT-1", reason="user-initiated")                # doctest: +SKIP
"""

from __future__ import annotations

import logging
from datetime import timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas import Approval, RelayError, ReplyAddress, new_approval, sign
from schemas.approvals import DEFAULT_APPROVAL_TTL
from schemas.transport import Transport
from schemas.wire import approval_message

from ._fleet import FleetView

__all__ = ["ApprovalSender", "NoApprovalTarget"]

log = logging.getLogger(__name__)


class NoApprovalTarget(RelayError, LookupError):
    """No VM can take the approval: the event is unknown, or none of its VMs is live."""


class ApprovalSender:
    """Signs and sends approvals. ``fleet`` (optional) picks targets and reply addresses."""

    def __init__(
        self,
        transport: Transport,
        signing_key: Ed25519PrivateKey,
        *,
        fleet: FleetView | None = None,
        decided_by: str = "approver",
        ttl: timedelta = DEFAULT_APPROVAL_TTL,
    ) -> None:
        self.transport = transport
        self.signing_key = signing_key
        self.fleet = fleet
        self.decided_by = decided_by
        self.ttl = ttl
        self.sent: list[Approval] = []
        self._odd: set[str] = set()

    def target(self, event_id: str, *, exclude: frozenset[str] = frozenset()) -> str:
        """The VM to send an approval for ``event_id``: the first live VM in ``Resources``,
        else the first that ever reported (its agent may be between heartbeats)."""
        fleet = self.fleet
        state = None if fleet is None else fleet.event(event_id)
        if fleet is None or state is None:
            raise NoApprovalTarget(
                f"event {event_id} is not known here: name the VM to approve it on"
            )
        skipped = {vm.casefold() for vm in exclude}
        for vm in fleet.live_vms(event_id):
            if vm.casefold() not in skipped:
                return vm
        for vm in state.reported():
            if vm.casefold() not in skipped and fleet.agent(vm) is not None:
                return vm
        raise NoApprovalTarget(
            f"event {event_id}: no VM of {list(state.resources)} has a live agent to apply it"
        )

    def reply_address(self, vm: str) -> ReplyAddress:
        """The VM's own address by the transport's convention. What its messages announce
        (``reply_to``) is only compared: a message is input, and an address taken from it
        could send the approval to another VM's queue or to a channel this transport does not
        have (a 1.0 agent's), so a different announcement is logged once and not followed."""
        own = self.transport.reply_address(vm)
        announced = None if self.fleet is None else self.fleet.reply_address(vm)
        if announced is not None and announced != own and vm.casefold() not in self._odd:
            self._odd.add(vm.casefold())
            log.warning(
                "VM %s announces reply address %s, not its own %s: approvals go to %s (an "
                "agent of another contract version, other channel names, or a forged message)",
                vm,
                announced,
                own,
                own,
            )
        return own

    def prepare(
        self,
        event_id: str,
        vm: str | None = None,
        *,
        event_version: str,
        reason: str = "",
        decided_by: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[Approval, ReplyAddress]:
        """A signed approval of ``event_id`` at ``event_version`` (the version that was judged:
        the agent applies it only while the live event has it) for ``vm`` (default:
        :meth:`target`), and where to send it; nothing is sent yet."""
        target = vm or self.target(event_id, exclude=exclude)
        approval = sign(
            new_approval(
                event_id,
                target,
                decided_by=decided_by or self.decided_by,
                event_version=event_version,
                reason=reason,
                ttl=self.ttl,
            ),
            self.signing_key,
        )
        return approval, self.reply_address(target)

    async def send(self, approval: Approval, address: ReplyAddress) -> None:
        """Send a prepared approval; returns once the broker confirmed it (sending the same
        approval again is harmless: the agent applies an approval id once)."""
        await self.transport.send_approval(address, approval_message(approval))
        self.sent.append(approval)
        del self.sent[:-1000]
        log.info(
            "approval %s of event %s (version %s) sent to %s (%s): %s",
            approval.approval_id,
            approval.event_id,
            approval.event_version,
            approval.vm,
            address,
            approval.reason or "no reason given",
        )

    async def approve(
        self,
        event_id: str,
        vm: str | None = None,
        *,
        event_version: str,
        reason: str = "",
        decided_by: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> Approval:
        """:meth:`prepare` and :meth:`send`: returns once the broker confirmed it."""
        approval, address = self.prepare(
            event_id,
            vm,
            event_version=event_version,
            reason=reason,
            decided_by=decided_by,
            exclude=exclude,
        )
        await self.send(approval, address)
        return approval
