"""The schema version every message carries, and the one rule for reading it.

A newer minor version decodes (its extra fields are ignored); another major version fails with
:class:`~schemas.VersionMismatch`, which names both versions. Golden fixtures of every message
kind live in ``tests/fixtures/<version>/`` and are never edited: a new version adds files.
"""

from __future__ import annotations

from ._errors import SchemaError, VersionMismatch

__all__ = ["SCHEMA_VERSION", "check_version"]

SCHEMA_VERSION = "1.2"


def _major(version: str) -> int:
    head, _, _ = version.partition(".")
    # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them (int()
    # refuses more than 4,300): anything else is not a version, never an exception of another
    # kind that a consumer would not expect from a bad message.
    if not (head.isascii() and head.isdigit()) or len(head) > 6:
        raise SchemaError(f"schema version {version[:40]!r} is not MAJOR.MINOR")
    return int(head)


_MAJOR = _major(SCHEMA_VERSION)


def check_version(found: object) -> str:
    """Return ``found`` when this code can read it; raise otherwise."""
    if found == SCHEMA_VERSION:  # nearly every message: checked on each one decoded
        return SCHEMA_VERSION
    if not isinstance(found, str) or not found:
        raise SchemaError("the message carries no schema version (schemaversion)")
    if _major(found) != _MAJOR:
        raise VersionMismatch(found, SCHEMA_VERSION)
    return found
