"""The api-versions IMDS accepts, and what each Scheduled Events version shows.

One list: the Scheduled Events versions are the contract's (:data:`schemas.imds.API_VERSIONS`).
The simulator adds only what the contract leaves out: the 2017-03-01 preview (agents never use it,
so the contract does not list it, but IMDS still answers it, with underscored resource names) and
the version that first showed each field or event type, keyed by the contract's versions (see
``shared/reference/scheduled-events-api.md``). The instance-metadata versions are Azure's general
IMDS list (not in the documents, nor in the contract); the simulator serves the same ``compute``
section for all of them. Attested data exists from 2018-10-01.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.imds import API_VERSIONS

__all__ = [
    "ATTESTED_VERSIONS",
    "FIRST_VERSION_WITH",
    "INSTANCE_VERSIONS",
    "LATEST_INSTANCE_VERSION",
    "LATEST_SCHEDULED_EVENTS_VERSION",
    "PREVIEW_VERSION",
    "SCHEDULED_EVENTS_VERSIONS",
    "EventFields",
    "event_fields",
]

#: The preview release, which the contract does not list.
PREVIEW_VERSION = "2017-03-01"

SCHEDULED_EVENTS_VERSIONS: tuple[str, ...] = (PREVIEW_VERSION, *API_VERSIONS)

#: The first contract version that showed each field or event type (the reference's table).
FIRST_VERSION_WITH: dict[str, str] = {
    "plain resource names": "2017-08-01",  # the preview prefixed IaaS names with "_"
    "Preempt": "2017-11-01",
    "Terminate": "2019-01-01",
    "Description": "2019-04-01",
    "EventSource": "2019-08-01",
    "DurationInSeconds": "2020-07-01",
}

INSTANCE_VERSIONS: tuple[str, ...] = (
    "2017-03-01",
    "2017-04-02",
    "2017-08-01",
    "2017-10-01",
    "2017-12-01",
    "2018-02-01",
    "2018-04-02",
    "2018-10-01",
    "2019-02-01",
    "2019-03-11",
    "2019-04-30",
    "2019-06-01",
    "2019-06-04",
    "2019-08-01",
    "2019-08-15",
    "2019-11-01",
    "2020-06-01",
    "2020-07-15",
    "2020-09-01",
    "2020-10-01",
    "2020-12-01",
    "2021-01-01",
    "2021-02-01",
    "2021-03-01",
    "2021-05-01",
    "2021-10-01",
    "2021-11-01",
    "2021-11-15",
    "2021-12-13",
    "2022-02-01",
    "2022-03-01",
    "2022-05-01",
    "2022-07-01",
    "2022-08-01",
    "2022-09-01",
    "2022-11-01",
    "2023-07-01",
)

LATEST_SCHEDULED_EVENTS_VERSION = SCHEDULED_EVENTS_VERSIONS[-1]
LATEST_INSTANCE_VERSION = INSTANCE_VERSIONS[-1]
ATTESTED_VERSIONS: tuple[str, ...] = tuple(v for v in INSTANCE_VERSIONS if v >= "2018-10-01")


@dataclass(frozen=True, slots=True)
class EventFields:
    """What one Scheduled Events api-version shows."""

    underscore_names: bool
    preempt: bool
    terminate: bool
    description: bool
    event_source: bool
    duration: bool


def event_fields(version: str) -> EventFields:
    """The fields and event types ``version`` shows; ``version`` must be a valid one.

    >>> event_fields("2017-11-01").terminate
    False
    """
    try:
        return _BY_VERSION[version]
    except KeyError:
        raise ValueError(f"not a Scheduled Events api-version: {version!r}") from None


def _fields_of(version: str) -> EventFields:
    # ISO dates compare correctly as strings.
    first = FIRST_VERSION_WITH
    return EventFields(
        underscore_names=version < first["plain resource names"],
        preempt=version >= first["Preempt"],
        terminate=version >= first["Terminate"],
        description=version >= first["Description"],
        event_source=version >= first["EventSource"],
        duration=version >= first["DurationInSeconds"],
    )


_BY_VERSION: dict[str, EventFields] = {v: _fields_of(v) for v in SCHEDULED_EVENTS_VERSIONS}
