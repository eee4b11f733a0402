"""Approval policies: small rules composed into a :class:`PolicySet`, configurable from TOML.

Three roles, evaluated in this order for an event still ``Scheduled``:

1. **vetoes** (:class:`NeverApprove`): the event is never approved here; NotBefore applies.
2. **approvers** (:class:`ApproveUserInitiated`, :class:`ApproveShortFreeze`,
   :class:`ApproveWhenHooksDone`): the first that approves wins...
3. **guards** (:class:`MaxUnavailable`): ...unless approving would take too many VMs of one
   group down at once; then the event waits and is decided again as others complete.

Nothing approves it: NotBefore lapses, and Azure starts the event on its own schedule.
Every evaluation ends in a :class:`Verdict` with its reason, recorded by the approver.

The policy file (every table optional)::

    [approve.user_initiated]              # EventSource "User": approve at once
    [approve.freeze]                      # Freeze with 0 <= DurationInSeconds < 9
    max_duration_seconds = 9
    [approve.hooks_done]                  # every VM in Resources ran its local hook
    event_types = ["Reboot", "Redeploy"]  # (optional) only these
    [never]
    event_types = ["Terminate"]
    [[max_unavailable]]                   # at most 1 VM per scale set down at once
    group_by = "scale_set"                # scale_set | zone | fault_domain | update_domain
    count = 1                             # or: percent = 25

An EventType the contract does not know (``"Terminat"``) is an error that lists the known ones:
a misspelt ``[never]`` veto would otherwise silently never apply. A type Azure added after this
version is named deliberately with ``unknown_event_types = ["Hibernate"]`` in the same table.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Protocol

from schemas import ConfigError, EventSource, EventType, HookResultMessage, VmIdentity
from schemas._files import read_setting_file

from ._fleet import GROUP_KEYS, EventPhase, EventState, FleetView

__all__ = [
    "Action",
    "ApproveShortFreeze",
    "ApproveUserInitiated",
    "ApproveWhenHooksDone",
    "MaxUnavailable",
    "NeverApprove",
    "Policy",
    "PolicySet",
    "Verdict",
    "load_policy_file",
    "parse_policy",
]


class Action(StrEnum):
    APPROVE = "approve"
    #: Not now: decided again on the next change (or NotBefore lapses).
    WAIT = "wait"
    #: Never approved here: NotBefore lapses.
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: str
    policy: str
    #: For a guard's ``wait``: the groups whose capacity held it (decided again when one of
    #: them changes).
    groups: tuple[tuple[str, object], ...] = ()


class Policy(Protocol):
    """One rule. ``evaluate`` returns None when it has no opinion on the event."""

    role: ClassVar[str]  # "veto", "approve" or "guard"

    @property
    def name(self) -> str: ...

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None: ...


def _types(values: Iterable[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(v.casefold() for v in values)


def _wanted(types: frozenset[str] | None, event: EventState) -> bool:
    return types is None or event.event_type.casefold() in types


@dataclass(frozen=True, slots=True)
class ApproveUserInitiated:
    """Events a person asked for (portal reboot, redeploy): approve at once."""

    event_types: frozenset[str] | None = None
    role: ClassVar[str] = "approve"
    name: str = "user_initiated"

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        if event.event.event_source == EventSource.USER and _wanted(self.event_types, event):
            return Verdict(Action.APPROVE, "user-initiated (EventSource User)", self.name)
        return None


@dataclass(frozen=True, slots=True)
class ApproveShortFreeze:
    """Freeze events announced to last 0 <= DurationInSeconds < ``max_duration_seconds``
    (a live migration pauses a VM for seconds; -1, unknown, is not short)."""

    max_duration_seconds: int = 9
    role: ClassVar[str] = "approve"
    name: str = "freeze"

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        if event.event_type != EventType.FREEZE:
            return None
        duration = event.event.duration_in_seconds
        if 0 <= duration < self.max_duration_seconds:
            return Verdict(
                Action.APPROVE,
                f"Freeze of {duration}s < {self.max_duration_seconds}s",
                self.name,
            )
        return None


@dataclass(frozen=True, slots=True)
class ApproveWhenHooksDone:
    """Approve once every VM in ``Resources`` reported its local hook(s) succeeded."""

    event_types: frozenset[str] | None = None
    role: ClassVar[str] = "approve"
    name: str = "hooks_done"

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        if not _wanted(self.event_types, event) or not event.resources:
            return None
        failed = [
            f"{r.data.hook} on {vm} {_how(r)}"
            for vm in event.resources
            for r in event.hooks_failed(vm)
        ]
        if failed:
            return Verdict(Action.WAIT, f"hook {'; '.join(failed)}", self.name)
        pending = [vm for vm in event.resources if not event.hooks_done(vm)]
        if pending:
            return Verdict(Action.WAIT, f"waiting for hooks on {', '.join(pending)}", self.name)
        return Verdict(Action.APPROVE, "every VM in Resources reported its hooks done", self.name)


def _how(result: HookResultMessage) -> str:
    data = result.data
    if data.outcome:
        return data.outcome
    return "timed out" if data.timed_out else f"failed (exit {data.exit_code})"


@dataclass(frozen=True, slots=True)
class NeverApprove:
    """Event types this service never approves (Terminate, say): NotBefore applies."""

    event_types: frozenset[str]
    role: ClassVar[str] = "veto"
    name: str = "never"

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        if event.event_type.casefold() in self.event_types:
            return Verdict(Action.NEVER, f"{event.event_type} is never approved here", self.name)
        return None


def _group_of(identity: VmIdentity | None, group_by: str) -> object:
    return None if identity is None else getattr(identity, group_by)


#: The most a ``percent`` may be: all of a group.
PERCENT_MAX = 100.0


def _within(value: float, maximum: float | None) -> bool:
    """0 <= ``value`` <= ``maximum`` (no bound when None), and a float finite: nan passes no
    comparison, so ``value < 0`` alone lets it through."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= 0 and (maximum is None or value <= maximum)


@dataclass(frozen=True, slots=True)
class MaxUnavailable:
    """At most ``count`` VMs (or ``percent`` % of the VMs known) of one group unavailable at
    once. A VM is unavailable while an event hitting it has started or was approved and is not
    over. An event whose own Resources exceed the cap is never approved: NotBefore applies.

    Costs what the event's groups cost, never a scan of the open events: the fleet view keeps
    each group's members and unavailable members up to date."""

    group_by: str
    count: int | None = None
    percent: float | None = None
    role: ClassVar[str] = "guard"
    name: str = "max_unavailable"

    def __post_init__(self) -> None:
        if self.group_by not in GROUP_KEYS:
            raise ConfigError(f"max_unavailable: group_by must be one of {', '.join(GROUP_KEYS)}")
        if (self.count is None) == (self.percent is None):
            raise ConfigError("max_unavailable: give exactly one of count or percent")
        # Checked here too, not only in the file: a nan or an inf would pass every comparison
        # and fail in limit(), at each event a policy approves.
        if self.count is not None and self.count < 0:
            raise ConfigError(f"max_unavailable: count must be >= 0, not {self.count!r}")
        if self.percent is not None and not _within(self.percent, PERCENT_MAX):
            raise ConfigError(
                f"max_unavailable: percent must be a number from 0 to {PERCENT_MAX:g}, "
                f"not {self.percent!r}"
            )

    def limit(self, fleet: FleetView, group: object) -> int:
        """How many VMs of ``group`` may be unavailable at once."""
        if self.percent is not None:
            return int(len(fleet.members(self.group_by, group)) * self.percent / 100)
        assert self.count is not None
        return self.count

    def room(self, fleet: FleetView, group: tuple[str, object]) -> int | None:
        """How many more VMs of ``group`` may become unavailable (negative when over the limit;
        None when this guard does not group by ``group``'s key)."""
        key, value = group
        if key != self.group_by:
            return None
        return self.limit(fleet, value) - len(fleet.down_in(key, value))

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        own = {vm.casefold() for vm in event.resources}
        groups = {_group_of(fleet.identity(vm), self.group_by) for vm in event.resources} - {None}
        for group in sorted(groups, key=str):
            members = fleet.members(self.group_by, group)
            down = fleet.down_in(self.group_by, group)
            if event.counted_down:  # its own VMs are counted below, once
                down = down - own
            hit = len(down) + sum(1 for vm in own if vm in members and vm not in down)
            limit = self.limit(fleet, group)
            if hit > limit:
                return Verdict(
                    Action.WAIT,
                    f"{hit} VMs of {self.group_by}={group} would be unavailable (at most {limit})",
                    f"{self.name}.{self.group_by}",
                    ((self.group_by, group),),
                )
        return None


@dataclass(frozen=True, slots=True)
class PolicySet:
    """The policies of one approver, in the order of :mod:`their roles <consumers._policies>`."""

    policies: Sequence[Policy] = field(default_factory=tuple)

    @classmethod
    def default(cls) -> PolicySet:
        """The documents' own sample policy: approve user-initiated events at once, approve
        Freeze with 0 <= DurationInSeconds < 9, leave everything else to NotBefore."""
        return cls((ApproveUserInitiated(), ApproveShortFreeze(9)))

    def decide(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict:
        if event.phase is not EventPhase.SCHEDULED:
            return Verdict(Action.WAIT, f"the event is {event.phase.value}", "lifecycle")
        for policy in self._role("veto"):
            verdict = policy.evaluate(event, fleet, now)
            if verdict is not None and verdict.action is Action.NEVER:
                return verdict
        approval: Verdict | None = None
        waiting: list[Verdict] = []
        for policy in self._role("approve"):
            verdict = policy.evaluate(event, fleet, now)
            if verdict is None:
                continue
            if verdict.action is Action.APPROVE:
                approval = verdict
                break
            waiting.append(verdict)
        if approval is None:
            when = event.event.not_before
            lapse = f"NotBefore {when.isoformat()} applies" if when else "NotBefore applies"
            if waiting:
                why = "; ".join(v.reason for v in waiting)
                return Verdict(Action.WAIT, f"{why}, else {lapse}", waiting[0].policy)
            return Verdict(Action.WAIT, f"no policy approves it: {lapse}", "default")
        for policy in self._role("guard"):
            verdict = policy.evaluate(event, fleet, now)
            if verdict is not None and verdict.action is not Action.APPROVE:
                return Verdict(
                    verdict.action,
                    f"{approval.reason}, but {verdict.reason}",
                    verdict.policy,
                    verdict.groups,
                )
        return approval

    def room(self, fleet: FleetView, group: tuple[str, object]) -> int | None:
        """The least room the guards leave in ``group`` (see :meth:`MaxUnavailable.room`);
        None when no guard groups by its key."""
        rooms = [
            room
            for policy in self._role("guard")
            if isinstance(policy, MaxUnavailable)
            and (room := policy.room(fleet, group)) is not None
        ]
        return min(rooms) if rooms else None

    def _role(self, role: str) -> Iterable[Policy]:
        return (p for p in self.policies if p.role == role)


# --------------------------------------------------------------------------------- the file


class _Table:
    """Reads one TOML table, naming the exact key in every error."""

    def __init__(self, source: str, path: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: [{path}] must be a table")
        self.source, self.path, self.data = source, path, dict(data)

    def _where(self, key: str) -> str:
        return f"{self.source}: {self.path}.{key}"

    def types(self, key: str, *, required: bool = False) -> frozenset[str] | None:
        value = self.data.pop(key, None)
        deliberate = self.data.pop("unknown_event_types", None)
        if deliberate is not None and (
            not isinstance(deliberate, list) or not all(isinstance(v, str) for v in deliberate)
        ):
            raise ConfigError(f"{self._where('unknown_event_types')} must be a list of names")
        if value is None and deliberate is None:
            if required:
                raise ConfigError(f"{self._where(key)} is required (a list of EventType names)")
            return None
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{self._where(key)} must be a list of EventType names")
        known = {t.value.casefold(): t.value for t in EventType}
        for name in value:
            if name.casefold() not in known:
                raise ConfigError(
                    f"{self._where(key)}: {name!r} is not an EventType (known: "
                    f"{', '.join(known.values())}); name a type Azure added after this version "
                    "in unknown_event_types = [...] instead"
                )
        return _types([*value, *(deliberate or [])])

    def number(
        self, key: str, *, integer: bool = False, maximum: float | None = None
    ) -> float | None:
        """A number from 0 to ``maximum`` (no bound when None); finite (TOML has nan and
        inf, which pass a ``< 0`` check)."""
        value: Any = self.data.pop(key, None)
        if value is None:
            return None
        wrong_kind = isinstance(value, bool) or not isinstance(value, int | float)
        if wrong_kind or (integer and not isinstance(value, int)) or not _within(value, maximum):
            kind = "a whole number" if integer else "a number"
            bounds = ">= 0" if maximum is None else f"from 0 to {maximum:g}"
            raise ConfigError(f"{self._where(key)} must be {kind} {bounds}, not {value!r}")
        return int(value) if integer else float(value)

    def text(self, key: str) -> str | None:
        value = self.data.pop(key, None)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self._where(key)} must be a string")
        return value

    def done(self, known: Iterable[str]) -> None:
        if self.data:
            key = sorted(self.data)[0]
            raise ConfigError(
                f"{self._where(key)}: unknown key (known here: {', '.join(known) or 'none'})"
            )


def parse_policy(data: Mapping[str, Any], source: str = "policy") -> PolicySet:
    """A :class:`PolicySet` from the decoded TOML; :class:`ConfigError` names a bad key."""
    top = _Table(source, "", data)
    policies: list[Policy] = []
    never = top.data.pop("never", None)
    if never is not None:
        table = _Table(source, "never", never)
        types = table.types("event_types", required=True)
        table.done(["event_types", "unknown_event_types"])
        assert types is not None
        policies.append(NeverApprove(types))
    approve = top.data.pop("approve", None)
    if approve is not None:
        approvers = _Table(source, "approve", approve)
        if "user_initiated" in approvers.data:
            table = _Table(source, "approve.user_initiated", approvers.data.pop("user_initiated"))
            policies.append(ApproveUserInitiated(table.types("event_types")))
            table.done(["event_types", "unknown_event_types"])
        if "freeze" in approvers.data:
            table = _Table(source, "approve.freeze", approvers.data.pop("freeze"))
            limit = table.number("max_duration_seconds", integer=True)
            table.done(["max_duration_seconds"])
            policies.append(ApproveShortFreeze(9 if limit is None else int(limit)))
        if "hooks_done" in approvers.data:
            table = _Table(source, "approve.hooks_done", approvers.data.pop("hooks_done"))
            policies.append(ApproveWhenHooksDone(table.types("event_types")))
            table.done(["event_types", "unknown_event_types"])
        approvers.path = "approve"
        if approvers.data:
            key = sorted(approvers.data)[0]
            raise ConfigError(
                f"{source}: approve.{key}: unknown policy (known: user_initiated, freeze, "
                "hooks_done)"
            )
    guards = top.data.pop("max_unavailable", None)
    if guards is not None:
        if isinstance(guards, Mapping):
            guards = [guards]
        if not isinstance(guards, list):
            raise ConfigError(f"{source}: max_unavailable must be [[max_unavailable]] tables")
        for index, raw in enumerate(guards):
            table = _Table(source, f"max_unavailable[{index}]", raw)
            group_by = table.text("group_by")
            count = table.number("count", integer=True)
            percent = table.number("percent", maximum=PERCENT_MAX)
            table.done(["group_by", "count", "percent"])
            if group_by is None:
                raise ConfigError(
                    f"{source}: max_unavailable[{index}].group_by is required "
                    f"({', '.join(GROUP_KEYS)})"
                )
            try:
                policies.append(
                    MaxUnavailable(group_by, None if count is None else int(count), percent)
                )
            except ConfigError as exc:
                raise ConfigError(f"{source}: max_unavailable[{index}]: {exc}") from exc
    top.path = "(top level)"
    if top.data:
        key = sorted(top.data)[0]
        raise ConfigError(
            f"{source}: {key}: unknown table (known: approve, never, max_unavailable)"
        )
    return PolicySet(tuple(policies))


#: The most of a policy file read: a policy is a few hundred bytes (and ``--policy /dev/zero``
#: must not read for ever).
MAX_POLICY_BYTES = 1024 * 1024


def load_policy_file(path: Path) -> PolicySet:
    """The policies of a TOML file. Whatever the file holds, :class:`ConfigError` naming it
    (not readable, too large, not UTF-8, not TOML, not a policy): the approver refuses to start
    with one line saying why."""
    raw = read_setting_file(path, MAX_POLICY_BYTES, "the policy file")
    if len(raw) > MAX_POLICY_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_POLICY_BYTES // 1024} KiB: not a policy file"
        )
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 (byte {exc.start} is not): a policy file is UTF-8 TOML"
        ) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path} is not valid TOML: nested too deeply") from exc
    except ValueError as exc:  # an integer longer than Python converts (4,300 digits)
        raise ConfigError(f"{path} is not valid TOML: {str(exc).split(':')[0]}") from exc
    return parse_policy(data, str(path))
