"""A state dir belongs to one VM. One that comes from another VM (a golden image captured from a
VM that ran the agent, a cloned or attached disk, a restored snapshot) was taken as this VM's
own: the other VM's unsent messages were published from here, its IMDS document diffed against
this VM's (its events reported ended, as this VM), its epoch and sequence continued on a second
VM. Now the store records its VM, and another VM's store is moved aside whole (never deleted)
and the agent starts afresh; the same VM restarting keeps everything, and a store an earlier
version wrote (no VM recorded) is adopted and kept.

A real agent on a real state dir, the simulator over HTTP (two VMs: two vmIds), the in-memory
broker and RabbitMQ."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import uuid
from pathlib import Path

import pytest

from publisher._origin import KEY_FILE
from publisher._state import STATE_FILE, StateStore
from publisher.simulator import EventSpec, EventType
from schemas import (
    MessageType,
    TransitionMessage,
)
from schemas.channels import ChannelNames

from .conftest import Broker
from .harness import recorder, running, scheduled_freezes, settings_for, simulator_server
from .test_state_corrupt import _meta
from .test_state_damaged import UNREADABLE_META, _sql


def _memory(name: str) -> Broker:
    unique = uuid.uuid4().hex[:8]
    return Broker(f"memory://{name}-{unique}", ChannelNames().suffixed(unique), "memory")


def _left_behind(vm: str) -> TransitionMessage:
    """A transition of ``vm`` as its agent builds one (a Scheduled Freeze of an event only this
    test knows), to leave unsent in an outbox."""
    (message,) = scheduled_freezes([f"LEFT-BEHIND-{uuid.uuid4().hex[:8].upper()}"], vm)
    return message


async def _leave_unsent(state: Path, vm: str) -> TransitionMessage:
    """Put a message of ``vm`` in the outbox as the agent would have (it found the broker down
    before it stopped)."""
    message = _left_behind(vm)
    store = await StateStore.open(state)
    try:
        await store.commit([message])
    finally:
        await store.close()
    return message


def _outbox_ids(db_file: Path) -> set[str]:
    db = sqlite3.connect(db_file)
    try:
        return {str(row[0]) for row in db.execute("SELECT message_id FROM outbox")}
    finally:
        db.close()


def _stored_cell(db_file: Path, key: str) -> tuple[str, bytes]:
    """A ``meta`` row as stored: its type and its bytes (text that is not UTF-8 included)."""
    db = sqlite3.connect(db_file)
    try:
        row = db.execute(
            "SELECT typeof(value), CAST(value AS BLOB) FROM meta WHERE key = ?", (key,)
        ).fetchone()
    finally:
        db.close()
    return str(row[0]), bytes(row[1])


def _moved(state: Path) -> list[Path]:
    return sorted(p for p in state.iterdir() if p.name.startswith(f"{STATE_FILE}.from-"))


async def test_a_state_dir_from_another_vm_is_moved_aside_and_nothing_of_that_vm_is_sent(
    broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The golden-image case: web-7's agent ran, left a message unsent and an event in its
    stored document; web-8 starts over the same directory. Before, web-8 published web-7's
    message (a broker with a user per VM refuses it; a shared user delivers another VM's stale
    message), reported web-7's event ended as web-8's, and went on with web-7's epoch."""
    state = tmp_path / "state"
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        own_event = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        web7 = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(web7):
            await rec.wait_for(lambda ms: any(m.subject == own_event.event_id for m in ms))
        await rec.wait_kind(MessageType.AGENT_OFFLINE)
        left = await _leave_unsent(state, "web-7")
        epoch_of_web7 = _meta(state / STATE_FILE, "epoch")
        seen_before = len(rec.messages)

        web8_event = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-8"], not_before_seconds=900)
        )
        web8 = settings_for(server, "web-8", broker.url, broker.channels, state)
        with caplog.at_level(logging.INFO, logger="publisher"):
            async with running(web8):
                await rec.wait_for(lambda ms: any(m.subject == web8_event.event_id for m in ms))
                await asyncio.sleep(1.0)  # time for anything else web-8 would send

    since = rec.messages[seen_before:]
    assert left.id not in {m.id for m in rec.messages}
    assert {m.vm.name for m in since} == {"web-8"}
    # web-7's event is not web-8's to report ended (it never was in web-8's IMDS).
    assert own_event.event_id not in {m.subject for m in since}
    assert web8_event.event_id in {m.subject for m in since if m.kind is MessageType.SCHEDULED}

    (moved,) = _moved(state)
    assert moved.name.startswith(f"{STATE_FILE}.from-web-7-")
    assert left.id in _outbox_ids(moved)  # kept whole, for a person to look at
    assert _meta(moved, "epoch") == epoch_of_web7
    new_epoch = _meta(state / STATE_FILE, "epoch")
    assert new_epoch is not None
    assert new_epoch != epoch_of_web7
    assert not _outbox_ids(state / STATE_FILE)  # web-8's own messages were all sent

    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = [w for w in warned if moved.name in w]
    assert "web-7" in warning
    assert "web-8" in warning
    assert "1 unsent message" in warning


async def test_the_same_vm_restarting_keeps_its_state_and_moves_nothing(tmp_path: Path) -> None:
    broker = _memory("owner-same")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        left = await _leave_unsent(state, "web-7")
        epoch = _meta(state / STATE_FILE, "epoch")
        async with running(settings):
            await rec.wait_for(lambda ms: left.id in {m.id for m in ms})
    assert not _moved(state)
    assert _meta(state / STATE_FILE, "epoch") == epoch


async def test_a_store_an_earlier_version_wrote_is_adopted_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that records no VM (an earlier version wrote it) is the opening VM's: its
    messages are sent, nothing is moved. From then on it is that VM's: another VM opening it
    moves it aside."""
    broker = _memory("owner-adopted")
    state = tmp_path / "state"
    left = await _leave_unsent(state, "web-8")  # written without an agent: no VM recorded
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        web8 = settings_for(server, "web-8", broker.url, broker.channels, state)
        with caplog.at_level(logging.INFO, logger="publisher"):
            async with running(web8):
                await rec.wait_for(lambda ms: left.id in {m.id for m in ms})
        assert not _moved(state)
        adopted = [r.getMessage() for r in caplog.records if "recorded no VM" in r.getMessage()]
        assert adopted
        assert "web-8" in adopted[0]

        web7 = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(web7):
            pass
    (moved,) = _moved(state)
    assert moved.name.startswith(f"{STATE_FILE}.from-web-8-")


#: Owner rows that name the VM web-7 as Azure compares names and vmIds (case does not count, a
#: vmId is a GUID compared by value; a vmId IMDS did not give is no reason to move the store).
SAME_VM = {
    "vm-id-in-upper-case": "UPDATE meta SET value = upper(value) WHERE key = 'owner_vm_id'",
    "vm-id-without-hyphens": (
        "UPDATE meta SET value = replace(value, '-', '') WHERE key = 'owner_vm_id'"
    ),
    "name-in-other-case": "UPDATE meta SET value = 'WEB-7' WHERE key = 'owner_name'",
    "vm-id-not-a-guid": "UPDATE meta SET value = 'None' WHERE key = 'owner_vm_id'",
    "name-only": (
        "UPDATE meta SET value = 'Web-7' WHERE key = 'owner_name'; "
        "DELETE FROM meta WHERE key = 'owner_vm_id'"
    ),
}


@pytest.mark.parametrize("edit", list(SAME_VM.values()), ids=list(SAME_VM))
async def test_the_same_vm_recorded_as_azure_compares_it_keeps_its_store(
    tmp_path: Path, edit: str
) -> None:
    broker = _memory("owner-case")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        assert _meta(state / STATE_FILE, "owner_name") == "web-7"
        db = sqlite3.connect(state / STATE_FILE)
        try:
            db.executescript(edit)
        finally:
            db.close()
        left = await _leave_unsent(state, "web-7")
        async with running(settings):
            await rec.wait_for(lambda ms: left.id in {m.id for m in ms})
    assert not _moved(state)


async def test_an_owner_row_that_cannot_be_read_is_no_reason_to_move_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An owner row of the wrong type or not UTF-8 (a hand edit, a damaged disk) does not say
    the store is another VM's: it is kept, said so, and recorded as this VM's again."""
    broker = _memory("owner-unreadable")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        _sql(
            state,
            "UPDATE meta SET value = CAST(x'ff' AS TEXT) WHERE key = 'owner_name'",
            "UPDATE meta SET value = x'00' WHERE key = 'owner_vm_id'",
        )
        left = await _leave_unsent(state, "web-7")
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                await rec.wait_for(lambda ms: left.id in {m.id for m in ms})
    assert not _moved(state)
    assert any("cannot be read" in r.getMessage() for r in caplog.records)
    assert _meta(state / STATE_FILE, "owner_name") == "web-7"


async def test_a_stored_vm_name_cannot_move_the_store_out_of_its_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The moved file is named after the VM the store records, which a hand edit (or a hostile
    copy) may have made anything: a path, a line break. The store stays in its directory, and
    the warning stays one line."""
    broker = _memory("owner-hostile")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        _sql(
            state,
            "UPDATE meta SET value = '../../evil' || char(10) || 'x' WHERE key = 'owner_name'",
            "UPDATE meta SET value = 'another-vm-id' WHERE key = 'owner_vm_id'",
        )
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                pass
    (moved,) = _moved(state)
    assert moved.parent == state
    assert moved.name.startswith(f"{STATE_FILE}.from-.._.._evil_x-")
    assert not (tmp_path / "evil").exists()
    (warning,) = [r.getMessage() for r in caplog.records if moved.name in r.getMessage()]
    assert "\n" not in warning


async def test_the_other_vms_origin_key_is_moved_aside_with_its_store(tmp_path: Path) -> None:
    """Where messages carry a signed origin (Service Bus), the key is made once in the state
    dir: every VM made from an image that held one signed with that one key, so any of them
    holding another's attestation of it (which travels with that VM's messages) could sign as
    that VM. It moves aside with the other VM's store, and this VM makes a key of its own."""
    broker = _memory("owner-key")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        web7 = settings_for(server, "web-7", broker.url, broker.channels, state, sign_messages="on")
        async with running(web7):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        key_of_web7 = (state / KEY_FILE).read_bytes()
        web8 = settings_for(server, "web-8", broker.url, broker.channels, state, sign_messages="on")
        async with running(web8):
            await rec.wait_for(lambda ms: any(m.vm.name == "web-8" for m in ms))
    (moved,) = _moved(state)
    suffix = moved.name.removeprefix(STATE_FILE)
    assert (state / f"{KEY_FILE}{suffix}").read_bytes() == key_of_web7
    assert (state / KEY_FILE).read_bytes() != key_of_web7


@pytest.mark.parametrize("damage", list(UNREADABLE_META.values()), ids=list(UNREADABLE_META))
async def test_a_state_dir_from_another_vm_is_moved_aside_whatever_its_sequence_or_revisions_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: tuple[str, str]
) -> None:
    """The golden image of a VM whose next_sequence or revisions row was damaged (a hand edit, a
    damaged disk). Every VM made from it stopped at open, before it knew its identity, with a
    ConfigError naming that row (exit 2, at every start): the store it would have moved aside
    unused ended the agent. Now the store is moved aside as any other VM's is, whole (the
    damaged row as it was, its unsent message kept), with the warning, and the agent starts
    with a store of its own."""
    key, value = damage
    broker = _memory("owner-damaged")
    state = tmp_path / "state"
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        web7 = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(web7):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        left = await _leave_unsent(state, "web-7")
        _sql(state, f"UPDATE meta SET value = {value} WHERE key = '{key}'")
        damaged = _stored_cell(state / STATE_FILE, key)
        web8 = settings_for(server, "web-8", broker.url, broker.channels, state)
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(web8):
                await rec.wait_for(lambda ms: any(m.vm.name == "web-8" for m in ms))
        await rec.wait_kind(MessageType.AGENT_OFFLINE, count=2)

    (moved,) = _moved(state)
    assert moved.name.startswith(f"{STATE_FILE}.from-web-7-")
    assert _stored_cell(moved, key) == damaged
    assert left.id in _outbox_ids(moved)
    assert left.id not in {m.id for m in rec.messages}
    web8_sequences = [m.sequence for m in rec.messages if m.vm.name == "web-8"]
    assert web8_sequences[0] == 1  # a store of its own, from its first sequence
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    (warning,) = [w for w in warned if moved.name in w]
    assert "web-7" in warning
    assert "web-8" in warning
    assert not [w for w in warned if f"row {key}" in w]  # the other VM's rows are not read
