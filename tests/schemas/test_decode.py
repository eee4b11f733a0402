"""Decoding hostile bytes: one decode, whatever the input a SchemaError and nothing else, and the
one-pass parse agrees with the careful one on every input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import SCHEMA_VERSION, SchemaError, decode
from schemas.messages import MAX_MESSAGE_BYTES, MAX_SEQUENCE, _decode_slowly, decode_newer

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures" / SCHEMA_VERSION).glob("*.json"))
MESSAGES = [p.read_bytes() for p in FIXTURES if p.stem != "approval"]


def _outcome(call: Any, raw: bytes) -> object:
    try:
        return ("ok", call(raw).model_dump(mode="json"))
    except SchemaError:
        return ("refused",)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[" * 100_000, "recursion limit"),
        (b"{" * 50_000 + b"}" * 50_000, "not JSON"),
        (b'{"a":' * 20_000 + b"1" + b"}" * 20_000, "recursion limit"),
        (b"\xff\xfe{}", "UTF-8"),
        (b"x" * (MAX_MESSAGE_BYTES + 1), "too large"),
        (b'{"specversion": NaN}', "not JSON"),
        (b'{"s": "\\ud800"}', "not JSON"),
    ],
    ids=["brackets", "braces", "objects", "utf16", "huge", "nan", "lone-surrogate"],
)
def test_hostile_bytes_are_a_schema_error_never_a_crash(raw: bytes, why: str) -> None:
    with pytest.raises(SchemaError, match=why):
        decode(raw)
    with pytest.raises(SchemaError):
        decode_newer(raw)


def _mutated(field: str, value: object) -> bytes:
    message = json.loads(MESSAGES[0])
    message[field] = value
    return json.dumps(message).encode()


@pytest.mark.parametrize(
    "version", ["\u00b2.1", "\u0661.0", "1" * 5000 + ".0"], ids=["superscript", "arabic", "huge"]
)
def test_a_schema_version_that_is_not_ascii_digits_is_a_schema_error(version: str) -> None:
    """``"\u00b2".isdigit()`` is true and ``int()`` refuses it (and more than 4,300 digits): the
    decoder raised ValueError, which no consumer expects from a bad message, and the stream
    stopped on it each time the broker delivered it again."""
    raw = _mutated("schemaversion", version)
    with pytest.raises(SchemaError, match=r"MAJOR\.MINOR"):
        decode(raw)
    with pytest.raises(SchemaError):
        _decode_slowly(raw)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_no_nan_or_infinity_in_a_number_field_on_either_path(token: str) -> None:
    """JSON has no NaN: the careful path refused it, and the one-pass parse took it into a
    float field (a hook's duration here), so the two paths disagreed on the same bytes."""
    message = json.loads(next(m for m in MESSAGES if b'"duration_seconds"' in m))
    message["data"]["duration_seconds"] = 1.5
    raw = (
        json.dumps(message)
        .encode()
        .replace(b'"duration_seconds": 1.5', token.encode().join([b'"duration_seconds": ', b""]))
    )
    assert token.encode() in raw
    with pytest.raises(SchemaError):
        decode(raw)


@pytest.mark.parametrize(
    "raw",
    [
        _mutated("sequence", MAX_SEQUENCE + 1),
        _mutated("sequence", 2**70),
        _mutated("subject", "a\u0000b"),
        _mutated("source", "\\u0000"[0:0] + "x\u0000"),
        _mutated("time", "0001-01-01T00:00:00+01:00"),  # before year 1 in UTC
        _mutated("time", "9999-12-31T23:00:00-05:00"),  # after year 9999 in UTC
    ],
    ids=[
        "sequence-over-int64",
        "sequence-2^70",
        "nul-in-subject",
        "nul-in-source",
        "time-before-year-1-utc",
        "time-after-9999-utc",
    ],
)
def test_what_no_database_can_store_is_refused_at_decode(raw: bytes) -> None:
    """The contract caps ``sequence`` at 2^63 - 1, forbids U+0000 and takes only times that
    exist in UTC: SQLite and PostgreSQL then store exactly the same messages (a time of year 1
    at +01:00 decoded, then broke the SQLite ledger's conversion to UTC)."""
    with pytest.raises(SchemaError):
        decode(raw)


def _fixture(name: str) -> dict[str, Any]:
    return json.loads(next(m for m, p in zip(MESSAGES, FIXTURES, strict=False) if p.stem == name))


@pytest.mark.parametrize(
    ("name", "subject"),
    [
        ("scheduled", "EVT-OTHER"),
        ("scheduled", None),
        ("approval.rejected", "EVT-OTHER"),
        ("hook.completed", "EVT-OTHER"),
        ("agent.heartbeat", "EVT-1"),
    ],
)
def test_the_subject_is_the_event_the_message_carries(name: str, subject: str | None) -> None:
    """The audit files a message under its subject: a VM's report of its own event sent
    under another event's id was that event's newest report (its timeline, and what
    ``approve EVENT --db`` bound the operator's approval to)."""
    message = _fixture(name)
    if subject is None:
        del message["subject"]
    else:
        message["subject"] = subject
    raw = json.dumps(message).encode()
    with pytest.raises(SchemaError, match="subject"):
        decode(raw)
    with pytest.raises(SchemaError):
        _decode_slowly(raw)


def test_a_literal_backslash_u0000_text_is_not_a_nul() -> None:
    raw = _mutated("source", "C:\\u0000path")  # the six characters \\u0000 after a backslash
    assert decode(raw).source == "C:\\u0000path"


@pytest.mark.parametrize(
    "field", ["specversion", "schemaversion", "type", "id", "source", "time", "data"]
)
def test_a_message_without_a_required_attribute_is_refused_by_both_paths(field: str) -> None:
    message = json.loads(MESSAGES[0])
    del message[field]
    raw = json.dumps(message).encode()
    assert _outcome(decode, raw) == _outcome(_decode_slowly, raw) == ("refused",)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def _inputs(draw: st.DrawFn) -> bytes:
    base = json.loads(draw(st.sampled_from(MESSAGES)))
    how = draw(st.sampled_from(["valid", "mutate", "drop", "truncate", "bytes"]))
    if how == "valid":
        return json.dumps(base).encode()
    if how == "mutate":
        path = draw(st.sampled_from([[k] for k in base] + [["data", k] for k in base["data"]]))
        target = base
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = draw(_json_values)
        return json.dumps(base).encode()
    if how == "drop":
        key = draw(st.sampled_from(sorted(base)))
        del base[key]
        return json.dumps(base).encode()
    raw = json.dumps(base).encode()
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw)))]
    position = draw(st.integers(0, len(raw) - 1))
    return raw[:position] + draw(st.binary(min_size=1, max_size=4)) + raw[position + 1 :]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_inputs())
def test_the_one_pass_parse_and_the_careful_parse_agree_on_every_input(raw: bytes) -> None:
    """Valid, mutated, truncated, attribute-less or corrupted: both paths accept the same
    message or both refuse it."""
    assert _outcome(decode, raw) == _outcome(_decode_slowly, raw)
