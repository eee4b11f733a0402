"""One list of Scheduled Events api-versions: the contract's, plus only what the simulator adds."""

from __future__ import annotations

from publisher.simulator import _versions
from schemas import imds


def test_the_simulator_serves_the_contracts_versions_plus_the_preview() -> None:
    served = _versions.SCHEDULED_EVENTS_VERSIONS
    assert served == (_versions.PREVIEW_VERSION, *imds.API_VERSIONS)
    assert _versions.PREVIEW_VERSION not in imds.API_VERSIONS
    assert served[-1] == _versions.LATEST_SCHEDULED_EVENTS_VERSION == imds.API_VERSIONS[-1]


def test_what_each_version_added_is_keyed_by_the_contracts_versions() -> None:
    assert set(_versions.FIRST_VERSION_WITH.values()) <= set(imds.API_VERSIONS)


def test_fields_follow_the_versions() -> None:
    preview = _versions.event_fields(_versions.PREVIEW_VERSION)
    assert preview.underscore_names
    assert not preview.preempt
    latest = _versions.event_fields(_versions.LATEST_SCHEDULED_EVENTS_VERSION)
    assert not latest.underscore_names
    assert all((latest.duration, latest.event_source, latest.description, latest.terminate))
