"""The central side: the fleet-wide stream, the fleet view, policies, approvals and audit.

>>> from consumers import FleetStream, FleetView          # doctest: +SKIP
>>> async with open_transport(url) as transport:          # doctest: +SKIP
...     async with FleetStream(transport, "ops") as stream:
...         async for message in stream:
...             view.apply(message)
"""

from ._approvals import ApprovalSender, NoApprovalTarget
from ._dedupe import DedupeWindow
from ._filters import MessageFilter
from ._fleet import AgentState, EventPhase, EventState, FleetView, SentApproval, VmReport
from ._origin import Origin, Unauthenticated
from ._policies import (
    Action,
    ApproveShortFreeze,
    ApproveUserInitiated,
    ApproveWhenHooksDone,
    MaxUnavailable,
    NeverApprove,
    Policy,
    PolicySet,
    Verdict,
    load_policy_file,
    parse_policy,
)
from ._stream import (
    DeadLetterReason,
    FleetStream,
    Rejected,
    StreamStats,
    classify_bad_input,
    dependency_unavailable,
)

__all__ = [
    "Action",
    "AgentState",
    "ApprovalSender",
    "ApproveShortFreeze",
    "ApproveUserInitiated",
    "ApproveWhenHooksDone",
    "DeadLetterReason",
    "DedupeWindow",
    "EventPhase",
    "EventState",
    "FleetStream",
    "FleetView",
    "MaxUnavailable",
    "MessageFilter",
    "NeverApprove",
    "NoApprovalTarget",
    "Origin",
    "Policy",
    "PolicySet",
    "Rejected",
    "SentApproval",
    "StreamStats",
    "Unauthenticated",
    "Verdict",
    "VmReport",
    "classify_bad_input",
    "dependency_unavailable",
    "load_policy_file",
    "parse_policy",
]
