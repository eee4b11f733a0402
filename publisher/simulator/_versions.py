"""The api-versions IMDS accepts, and what each Scheduled Events version shows.

Scheduled Events versions and what each added come from the documents (see
``shared/reference/scheduled-events-api.md``). The instance-metadata versions are Azure's general
IMDS list (not in the documents); the simulator serves the same ``compute`` section for all of
them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "INSTANCE_VERSIONS",
    "LATEST_INSTANCE_VERSION",
    "LATEST_SCHEDULED_EVENTS_VERSION",
    "SCHEDULED_EVENTS_VERSIONS",
    "EventFields",
    "event_fields",
]

SCHEDULED_EVENTS_VERSIONS: tuple[str, ...] = (
    "2017-03-01",  # preview: IaaS resource names carry a leading underscore
    "2017-08-01",  # underscore removed; Metadata header enforced
    "2017-11-01",  # EventType Preempt
    "2019-01-01",  # EventType Terminate
    "2019-04-01",  # Description
    "2019-08-01",  # EventSource
    "2020-07-01",  # DurationInSeconds
)

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
    return EventFields(
        underscore_names=version < "2017-08-01",
        preempt=version >= "2017-11-01",
        terminate=version >= "2019-01-01",
        description=version >= "2019-04-01",
        event_source=version >= "2019-08-01",
        duration=version >= "2020-07-01",
    )


_BY_VERSION: dict[str, EventFields] = {v: _fields_of(v) for v in SCHEDULED_EVENTS_VERSIONS}
