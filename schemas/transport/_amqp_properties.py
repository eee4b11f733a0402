"""A message's AMQP properties, read so that what cannot be read costs that property only.

Whoever publishes a message chooses its content header, and RabbitMQ passes it on as it was
published. pamqp raises on some of what the broker passes: a string property or a header name
that is not UTF-8, a timestamp beyond the years a ``datetime`` holds (in a property or a
header), headers nested deeper than Python's recursion limit. It raises while aiormq reads the
frame, and aiormq then ends the whole connection: every subscription and the publishing
channel with it. The broker delivers the message again after the reconnect, and the link goes
down again, for as long as the message stays in its queue; one hostile publisher stops a
consumer group (or an agent's approvals) for good.

Importing this module makes pamqp read such a content header one property at a time: each
property it cannot read is left out (None; unreadable headers are left out as a whole), the
message is delivered with the others, and a warning says which were left out. The consumer
then judges it on its body, like any other message (a sender it cannot read is no sender: an
origin check refuses it). Content headers that pamqp reads are read as before, by pamqp alone.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from pamqp import commands as spec
from pamqp import decode

__all__: list[str] = []

log = logging.getLogger(__name__)

#: What pamqp raises on a value it cannot read (RecursionError: nesting; OverflowError and
#: ValueError: a timestamp beyond datetime; UnicodeDecodeError, a ValueError: not UTF-8).
_UNREADABLE = (ValueError, OverflowError, OSError, RecursionError, struct.error)
#: The width on the wire of the fixed-size property types.
_FIXED_WIDTH = {"octet": 1, "timestamp": 8}

_read_strictly = spec.Basic.Properties.unmarshal


def _read(properties: spec.Basic.Properties, flags: int, data: bytes) -> None:
    """pamqp's reading of the properties; when it fails, :func:`_read_leniently`."""
    try:
        _read_strictly(properties, flags, data)
    except _UNREADABLE as exc:
        _read_leniently(properties, flags, data, exc)


def _read_leniently(
    properties: spec.Basic.Properties, flags: int, data: bytes, error: BaseException
) -> None:
    """Read each property present on its own, leaving out (None) those pamqp cannot read.
    Every property's width is known before its value is read, so one that cannot be read does
    not hide those after it; a header too short for its properties is a broken frame, and
    raises as before."""
    unreadable: list[str] = []
    offset = 0
    for name in properties.__slots__:
        if not flags & properties.flags[name]:
            continue
        kind = properties.amqp_type(name)
        if kind == "shortstr":
            width = 1 + data[offset] if offset < len(data) else 1
        elif kind == "table":
            width = 4 + int.from_bytes(data[offset : offset + 4], "big")
        else:
            width = _FIXED_WIDTH[kind]
        field = data[offset : offset + width]
        if len(field) < width:
            raise ValueError(f"the content header ends inside property {name}") from error
        offset += width
        value: Any
        try:
            _, value = decode.by_type(field, kind)
        except _UNREADABLE:
            value = None
            unreadable.append(name)
        setattr(properties, name, value)
    if not unreadable:  # pamqp failed where the stack was deeper: read in full here
        return
    log.warning(
        "message %r: its AMQP propert%s %s could not be read (%s: %r): delivered without %s; "
        "the consumer judges it on its body",
        (properties.message_id or "")[:200],  # the publisher's text: quoted, never raw
        "y" if len(unreadable) == 1 else "ies",
        ", ".join(unreadable),
        type(error).__name__,
        str(error)[:200],
        "it" if len(unreadable) == 1 else "them",
    )


spec.Basic.Properties.unmarshal = _read  # type: ignore[method-assign,assignment]
