"""The public surface stays explicit and complete."""

from __future__ import annotations

import inspect

import publisher.simulator as simulator


def test_all_names_exist() -> None:
    for name in simulator.__all__:
        assert hasattr(simulator, name), name


def test_every_public_object_is_exported() -> None:
    public = {
        name
        for name, value in vars(simulator).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", "publisher.simulator").startswith("publisher.simulator")
    }
    assert public <= set(simulator.__all__)
    assert sorted(simulator.__all__) == sorted(set(simulator.__all__))
