"""Who may speak for a VM: a lifecycle message is acted on only when its origin is the VM it
describes.

Every message carries the identity of the VM it is about (``data.vm``); anyone holding some VM's
broker credential could put another VM's name there. So before a message reaches the dedupe
window (where a forgery could shadow the genuine message) or a handler, :func:`authenticate`
checks three things:

1. **The sender may speak for that VM.** The sender is what the broker vouches for
   (:attr:`~schemas.transport.Delivery.sender`: RabbitMQ's validated ``user_id``). The
   operator's mapping (:class:`Origin`) says which broker user is which VM:

   ==================  =====================================================================
   ``vm-user``         one broker user per VM, named :func:`~schemas.channels.vm_word` of it
   ``scale-set-user``  one broker user per scale set (its name, lower case) for VMs named
                       ``<scale set>_<instance>``; a VM outside a scale set has its own user
   ``signed``          no broker user (Service Bus): the message is signed with a key Azure
                       attested for the VM's vmId (:mod:`schemas.origin`)
   ``any``             no check: development, or a broker only trusted agents can reach
   ==================  =====================================================================

2. **The message is that VM's own**: its CloudEvents ``source`` is the VM's (its resource id,
   whose name must be the VM's name).
3. **Its id is the one the agent would have made** (:func:`schemas.messages.expected_id`), so
   nobody can publish, under its own name, a message carrying the id of another VM's future
   message.

A message that fails is dead-lettered (``origin-mismatch``) with the reason and counted.
"""

from __future__ import annotations

import re
from enum import StrEnum

from schemas import LifecycleMessage, NewerMessage, RelayError, VmIdentity, vm_word
from schemas.messages import expected_id
from schemas.origin import OriginRejected, OriginVerifier
from schemas.transport import Delivery

__all__ = ["Origin", "Unauthenticated", "authenticate", "default_origin"]

# .../virtualMachineScaleSets/<scale set>/virtualMachines/<instance>
_SCALE_SET_VM = re.compile(
    r"/virtualMachineScaleSets/(?P<scale_set>[^/]+)/virtualMachines/(?P<instance>[^/]+)$",
    re.IGNORECASE,
)
_VM = re.compile(r"/virtualMachines/(?P<name>[^/]+)$", re.IGNORECASE)
_SCALE_SET_NAME = re.compile(r"^(?P<scale_set>.+)_(?P<instance>\d+)$")


class Unauthenticated(RelayError):
    """A message whose origin is not the VM it describes; the text says why."""


class Origin(StrEnum):
    """How a broker user maps to the VMs it may speak for (see the module docstring)."""

    VM_USER = "vm-user"
    SCALE_SET_USER = "scale-set-user"
    SIGNED = "signed"
    ANY = "any"

    def allows(self, sender: str | None, vm: VmIdentity) -> str | None:
        """None when ``sender`` may speak for ``vm``, else why not (for the broker-user
        mappings; a signed origin is checked by :func:`authenticate`)."""
        if self in (Origin.ANY, Origin.SIGNED):
            return None
        if not sender:
            return (
                "the broker names no sender (RabbitMQ's user_id is not set): with origin "
                f"{self.value}, only a message its VM published is acted on"
            )
        who = sender.casefold()
        own = vm_word(vm.name)
        if self is Origin.VM_USER:
            if who == own:
                return None
            return f"broker user {sender!r} may speak only for VM {sender!r}, not {vm.name!r}"
        match = _SCALE_SET_NAME.match(vm.name)
        scale_set = match["scale_set"] if match else None
        if scale_set is None:
            if who == own:
                return None
            return f"broker user {sender!r} is not VM {vm.name!r}, which is in no scale set"
        if who != vm_word(scale_set):
            return f"broker user {sender!r} is not scale set {scale_set!r} of VM {vm.name!r}"
        if vm.scale_set is not None and vm.scale_set.casefold() != scale_set.casefold():
            return f"VM {vm.name!r} claims scale set {vm.scale_set!r}: its name says {scale_set!r}"
        return None


def default_origin(broker_kind: str) -> Origin:
    """What a service checks when the operator says nothing: every message authenticated on a
    networked broker (by its broker user on RabbitMQ, by its signature on Service Bus, where
    the broker names no sender); nothing to check in one process (``memory://``)."""
    if broker_kind == "memory":
        return Origin.ANY
    return Origin.SIGNED if broker_kind == "servicebus" else Origin.VM_USER


def _source_problem(message: LifecycleMessage) -> str | None:
    vm = message.vm
    if message.source != vm.source:
        return f"source {message.source!r} is not VM {vm.name!r}'s ({vm.source!r})"
    resource = vm.resource_id
    if not resource:
        return None
    scale_set_vm = _SCALE_SET_VM.search(resource)
    if scale_set_vm is not None:
        name = f"{scale_set_vm['scale_set']}_{scale_set_vm['instance']}"
    else:
        plain = _VM.search(resource)
        if plain is None:
            return f"resource id {resource!r} names no virtual machine"
        name = plain["name"]
    if name.casefold() != vm.name.casefold():
        return f"resource id {resource!r} is not VM {vm.name!r}"
    return None


def authenticate(
    message: LifecycleMessage | NewerMessage,
    delivery: Delivery,
    origin: Origin,
    verifier: OriginVerifier | None = None,
) -> None:
    """Raise :class:`Unauthenticated` unless ``message`` is its VM's own: sent by a broker user
    that may speak for that VM, or signed by a key Azure attested for it."""
    if origin is Origin.SIGNED:
        if verifier is None:
            raise Unauthenticated("origin signed, but no attestation CA to check it with")
        vm = message.data.get("vm") if isinstance(message, NewerMessage) else None
        vm_id = (
            (str(vm.get("vm_id", "")) if isinstance(vm, dict) else "")
            if isinstance(message, NewerMessage)
            else message.vm.vm_id
        )
        name = message.vm_name if isinstance(message, NewerMessage) else message.vm.name
        try:
            verifier.check(
                delivery.body, delivery.properties, vm_name=name, vm_id=vm_id, written=message.time
            )
        except OriginRejected as exc:
            raise Unauthenticated(str(exc)) from exc
        if isinstance(message, NewerMessage):
            return
    if isinstance(message, NewerMessage):
        # A type this version cannot read: only the sender can be checked, against the name.
        name = message.vm_name
        problem = origin.allows(delivery.sender, VmIdentity(name=name)) if name else "no VM"
        if problem:
            raise Unauthenticated(problem)
        return
    problem = origin.allows(delivery.sender, message.vm)
    if problem is None and origin is not Origin.ANY:
        problem = _source_problem(message)
        if problem is None:
            expected = expected_id(message)
            if expected is not None and expected != message.id:
                problem = (
                    f"id {message.id} is not the one VM {message.vm.name!r}'s agent makes for "
                    f"this message ({expected})"
                )
    if problem:
        raise Unauthenticated(problem)
