"""The approver and a VM that changes groups (its scale set, zone, fault or update domain, e.g.
after a redeploy or a metadata correction): the events a cap per group holds are decided again
where the move frees room, at once, and never approved past a cap because of it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from consumers import Action, ApproveUserInitiated, MaxUnavailable, PolicySet
from consumers._approver import ApproverService
from consumers._fleet import GROUP_KEYS
from schemas import VmIdentity
from schemas.approvals import generate_signing_key
from schemas.transport import MemoryTransport

from ._factory import event, heartbeat, transition, vm

#: Two values of each group key: where the VM was, and where it goes.
_VALUES: dict[str, tuple[Any, Any, Any]] = {
    "scale_set": ("S", "S2", "S3"),
    "zone": ("1", "2", "3"),
    "fault_domain": (0, 1, 2),
    "update_domain": (0, 1, 2),
}


@pytest.fixture
async def transport():
    async with MemoryTransport(f"approver-{uuid.uuid4().hex}") as memory:
        yield memory


def member(name: str, group_by: str, value: object) -> VmIdentity:
    """VM ``name`` in group ``group_by=value`` (and in no other group)."""
    return vm(name).model_copy(update={group_by: value})


def approver(transport: MemoryTransport, guard: MaxUnavailable, now: datetime) -> ApproverService:
    return ApproverService(
        transport,
        generate_signing_key(),
        policies=PolicySet((ApproveUserInitiated(), guard)),
        clock=lambda: now,
    )


def actions(service: ApproverService, event_id: str) -> list[Action]:
    return [d.action for d in service.decisions if d.event_id == event_id]


async def put_down(service: ApproverService, identity: VmIdentity, how: str, now: datetime):
    """Make ``identity``'s VM unavailable: its event started, or it was approved (the approval
    is out, the event not started yet). Returns the event."""
    if how == "started":
        busy = event(f"BUSY-{identity.name}", resources=(identity.name,), status="Started")
        await service.handle(transition("started", busy, identity, at=now))
        return busy
    busy = event(f"BUSY-{identity.name}", source="User", resources=(identity.name,))
    await service.handle(transition("scheduled", busy, identity, at=now))
    assert actions(service, busy.event_id) == [Action.APPROVE]
    return busy


@pytest.mark.parametrize("how", ["started", "approved"])
@pytest.mark.parametrize("group_by", GROUP_KEYS)
async def test_a_vm_down_that_moves_to_another_group_frees_its_old_group_at_once(
    transport, group_by, how
):
    """At most one VM down per group. VM a is down in group G (its event started, or it was
    approved): b's event in G waits. a's heartbeat says it is in G2 now (a redeploy, a
    corrected metadata): G has room again, and b's event is decided again and approved at once.
    Before, a's leaving G was not reported as room freed there, and b's event waited for the
    next change in G (or its NotBefore)."""
    now = datetime.now(UTC)
    old, new, _ = _VALUES[group_by]
    service = approver(transport, MaxUnavailable(group_by, count=1), now)
    a, b = member("a", group_by, old), member("b", group_by, old)
    for identity in (a, b):
        await service.handle(heartbeat(identity, at=now))
    await put_down(service, a, how, now)
    await service.handle(
        transition("scheduled", event("NEXT", source="User", resources=("b",)), b, at=now)
    )
    assert actions(service, "NEXT") == [Action.WAIT]
    await service.handle(heartbeat(member("a", group_by, new), at=now))
    assert actions(service, "NEXT") == [Action.WAIT, Action.APPROVE]
    assert service.fleet.down_in(group_by, old) == {"b"}
    assert service.fleet.down_in(group_by, new) == {"a"}


@pytest.mark.parametrize("how", ["started", "approved"])
async def test_a_vm_down_that_moves_in_counts_against_its_new_groups_cap(transport, how):
    """The other side of the move: scale set S2 has c down, so d's event there waits. a, down
    in S, moves to S2: S frees (b's event is approved), and S2 now has two VMs down. When c's
    maintenance ends, d's event is decided again and still waits (a is down in S2); it is
    approved once a's ends too. Never two VMs of S2 down at once because of the move."""
    now = datetime.now(UTC)
    service = approver(transport, MaxUnavailable("scale_set", count=1), now)
    a, b = vm("a", scale_set="S"), vm("b", scale_set="S")
    c, d = vm("c", scale_set="S2"), vm("d", scale_set="S2")
    for identity in (a, b, c, d):
        await service.handle(heartbeat(identity, at=now))
    busy_a = await put_down(service, a, how, now)
    busy_c = event("BUSY-c", resources=("c",), status="Started")
    await service.handle(transition("started", busy_c, c, at=now))
    await service.handle(
        transition("scheduled", event("NEXT-b", source="User", resources=("b",)), b, at=now)
    )
    await service.handle(
        transition("scheduled", event("NEXT-d", source="User", resources=("d",)), d, at=now)
    )
    assert actions(service, "NEXT-b") == [Action.WAIT]
    assert actions(service, "NEXT-d") == [Action.WAIT]

    a = vm("a", scale_set="S2")
    await service.handle(heartbeat(a, at=now))
    assert actions(service, "NEXT-b") == [Action.WAIT, Action.APPROVE]
    assert actions(service, "NEXT-d") == [Action.WAIT]
    assert service.fleet.down_in("scale_set", "S2") == {"a", "c"}

    await service.handle(transition("completed", busy_c, c, at=now))
    assert service.fleet.down_in("scale_set", "S2") == {"a"}
    assert actions(service, "NEXT-d") == [Action.WAIT]  # decided again: the same, recorded once
    done_a = event(busy_a.event_id, resources=("a",), status="Started")
    await service.handle(transition("completed", done_a, a, at=now))
    assert actions(service, "NEXT-d") == [Action.WAIT, Action.APPROVE]


async def test_a_vm_down_that_moves_frees_room_under_a_percent_cap_on_both_sides(transport):
    """Half of a scale set may be down. S is a, b, c (one may be down): a is down, b's event
    waits. S2 is d, e (one may be down): d is down, e's event waits. a moves to S2: S is b, c,
    still one may be down and none is, so b's event is approved at once; S2 is a, d, e, one may
    be down and two are, so e's event still waits, and still after d's maintenance ends (a is
    down there), until a's ends too."""
    now = datetime.now(UTC)
    service = approver(transport, MaxUnavailable("scale_set", percent=50), now)
    ids = {name: vm(name, scale_set="S") for name in ("a", "b", "c")}
    ids |= {name: vm(name, scale_set="S2") for name in ("d", "e")}
    for identity in ids.values():
        await service.handle(heartbeat(identity, at=now))
    busy_a = await put_down(service, ids["a"], "started", now)
    busy_d = await put_down(service, ids["d"], "started", now)
    for name in ("b", "e"):
        ev = event(f"NEXT-{name}", source="User", resources=(name,))
        await service.handle(transition("scheduled", ev, ids[name], at=now))
        assert actions(service, ev.event_id) == [Action.WAIT]

    ids["a"] = vm("a", scale_set="S2")
    await service.handle(heartbeat(ids["a"], at=now))
    assert actions(service, "NEXT-b") == [Action.WAIT, Action.APPROVE]
    assert actions(service, "NEXT-e") == [Action.WAIT]

    await service.handle(transition("completed", busy_d, ids["d"], at=now))
    assert actions(service, "NEXT-e") == [Action.WAIT]
    await service.handle(transition("completed", busy_a, ids["a"], at=now))
    assert actions(service, "NEXT-e") == [Action.WAIT, Action.APPROVE]


async def test_the_event_of_a_vm_that_moves_is_held_by_its_new_group_and_freed_with_it(
    transport,
):
    """At most one VM down per scale set. a is down in S, so b's event waits on S. b's
    heartbeat says it is in S3 now, where c is down: b's event waits on S3 now. When c's
    maintenance ends, S3 has room and b's event is approved at once. Before, b's event stayed
    held on S, its old group: S3's room never reached it, and it waited for a change in S (or
    its NotBefore)."""
    now = datetime.now(UTC)
    service = approver(transport, MaxUnavailable("scale_set", count=1), now)
    a, b, c = vm("a", scale_set="S"), vm("b", scale_set="S"), vm("c", scale_set="S3")
    for identity in (a, b, c):
        await service.handle(heartbeat(identity, at=now))
    await put_down(service, a, "started", now)
    busy_c = await put_down(service, c, "started", now)
    await service.handle(
        transition("scheduled", event("NEXT", source="User", resources=("b",)), b, at=now)
    )
    assert actions(service, "NEXT") == [Action.WAIT]

    await service.handle(heartbeat(vm("b", scale_set="S3"), at=now))
    held = [d for d in service.decisions if d.event_id == "NEXT"]
    assert [d.action for d in held] == [Action.WAIT, Action.WAIT]
    assert "scale_set=S3" in held[-1].reason

    await service.handle(transition("completed", busy_c, c, at=now))
    assert actions(service, "NEXT") == [Action.WAIT, Action.WAIT, Action.APPROVE]


async def test_the_event_of_a_vm_that_moves_to_a_group_with_room_is_approved_at_once(transport):
    """a is down in S, so b's event waits on S; b moves to S3, where nobody is down: its event
    is approved at once, not at the next change in S."""
    now = datetime.now(UTC)
    service = approver(transport, MaxUnavailable("scale_set", count=1), now)
    a, b = vm("a", scale_set="S"), vm("b", scale_set="S")
    for identity in (a, b):
        await service.handle(heartbeat(identity, at=now))
    await put_down(service, a, "started", now)
    await service.handle(
        transition("scheduled", event("NEXT", source="User", resources=("b",)), b, at=now)
    )
    assert actions(service, "NEXT") == [Action.WAIT]
    await service.handle(heartbeat(vm("b", scale_set="S3"), at=now))
    assert actions(service, "NEXT") == [Action.WAIT, Action.APPROVE]
