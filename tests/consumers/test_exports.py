"""The public surface of ``consumers`` stays explicit and complete."""

import types

import consumers


def test_all_lists_every_public_name_and_only_those():
    public = {
        name
        for name, value in vars(consumers).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(consumers.__all__) == public
    assert all(getattr(consumers, name) is not None for name in consumers.__all__)
