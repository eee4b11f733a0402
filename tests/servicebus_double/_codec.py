"""AMQP 1.0 message sections: split what a client sent, splice what a receiver gets.

The double stores each message as the bytes the client encoded and, on delivery, rebuilds only
the sections the broker owns (header, message annotations, and application properties for
dead-lettered messages). The other sections travel byte for byte, so properties and body round
trip exactly as the SDK wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from proton import Data, Described, symbol, timestamp, uint, ulong

HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
FOOTER = 0x78
SECTION_CODES = range(HEADER, FOOTER + 1)


class SectionError(ValueError):
    """The bytes are not a sequence of AMQP message sections."""


@dataclass(frozen=True)
class Section:
    code: int
    value: Any
    raw: bytes


def split_sections(payload: bytes) -> list[Section]:
    sections: list[Section] = []
    pos = 0
    while pos < len(payload):
        if payload[pos] != 0x00:  # every section is a described type
            raise SectionError(f"not a message section at byte {pos}")
        data = Data()
        try:
            consumed = data.decode(payload[pos:])
            data.rewind()
            data.next()
            value = data.get_object()
        except Exception as exc:  # proton raises DataException, ValueError and friends
            raise SectionError(f"undecodable section at byte {pos}") from exc
        if consumed <= 0:
            raise SectionError(f"empty section at byte {pos}")
        if not isinstance(value, Described) or value.descriptor not in SECTION_CODES:
            raise SectionError(f"not a message section at byte {pos}: {value!r}")
        inner = value.value
        if isinstance(inner, memoryview):  # proton's view dies with its Data: copy it now
            inner = bytes(inner)
        code = cast(int, value.descriptor)
        sections.append(Section(int(code), inner, payload[pos : pos + consumed]))
        pos += consumed
    return sections


def unbatch(payload: bytes) -> list[bytes]:
    """The messages inside an SDK batch (format 0x80013700), or ``[payload]`` if not a batch.

    The python-qpid-proton binding does not expose a transfer's message-format, so a batch is
    recognised by its shape: every data section is itself a whole encoded message. (A single
    message whose body happens to be an encoded AMQP message would be mistaken for a batch.)
    """
    sections = split_sections(payload)
    bodies = [s.value for s in sections if s.code == DATA]
    if not bodies:
        return [payload]
    inner: list[bytes] = []
    for body in bodies:
        try:
            parts = split_sections(bytes(body))
        except SectionError:
            return [payload]
        if not parts:
            return [payload]
        inner.append(bytes(body))
    return inner


def routing_keys(payload: bytes) -> tuple[str | None, str | None]:
    """``(message_id, session_id)`` of an encoded message, as strings."""
    for section in split_sections(payload):
        if section.code == PROPERTIES:
            fields = list(section.value) + [None] * 13
            message_id = fields[0]
            group_id = fields[10]
            return (
                None if message_id is None else str(message_id),
                None if group_id is None else str(group_id),
            )
    return None, None


def time_to_live(payload: bytes) -> float | None:
    """The header's ``ttl`` in seconds, if the sender set one."""
    for section in split_sections(payload):
        if section.code == HEADER:
            fields = list(section.value) + [None] * 5
            ttl = fields[2]
            return None if not ttl else int(ttl) / 1000.0
    return None


def _encode(code: int, value: Any) -> bytes:
    data = Data()
    data.put_object(Described(ulong(code), value))
    return bytes(data.encode())


def build_delivery(
    payload: bytes,
    *,
    delivery_count: int,
    annotations: dict[str, Any],
    extra_properties: dict[str, Any] | None = None,
) -> bytes:
    """Re-encode a stored message with the broker's header, annotations and properties."""
    sections = split_sections(payload)
    header: list[Any] = [None, None, None, None, None]
    delivery_annotations = b""
    message_annotations: dict[Any, Any] = {}
    application_properties: dict[Any, Any] | None = None
    application_raw = b""
    properties_raw = b""
    rest = b""
    for section in sections:
        if section.code == HEADER:
            header = (list(section.value) + [None] * 5)[:5]
        elif section.code == DELIVERY_ANNOTATIONS:
            delivery_annotations = section.raw
        elif section.code == MESSAGE_ANNOTATIONS:
            message_annotations = dict(section.value or {})
        elif section.code == PROPERTIES:
            properties_raw = section.raw
        elif section.code == APPLICATION_PROPERTIES:
            application_properties = dict(section.value or {})
            application_raw = section.raw
        else:
            rest += section.raw
    header[4] = uint(delivery_count)
    message_annotations.update({symbol(k): v for k, v in annotations.items()})
    if extra_properties:
        merged = dict(application_properties or {})
        merged.update(extra_properties)
        application_raw = _encode(APPLICATION_PROPERTIES, merged)
    return b"".join(
        [
            _encode(HEADER, header),
            delivery_annotations,
            _encode(MESSAGE_ANNOTATIONS, message_annotations),
            properties_raw,
            application_raw,
            rest,
        ]
    )


def ms_timestamp(epoch_seconds: float) -> timestamp:
    return timestamp(int(epoch_seconds * 1000))
