"""The simulator's exceptions, under the project's root (:class:`schemas.RelayError`), with the
builtin mix-in that matches each meaning.

::

    RelayError
    └── SimulatorError
        ├── ConfigError(schemas.ConfigError)  a bad setting: speed, rate limit, CLI flag
        ├── UnknownVmError(LookupError)       no VM by that name
        ├── DuplicateVmError(ValueError)      a VM by that name exists already
        ├── InvalidVmNameError(ValueError)    a name that cannot be a VM's (or a URL segment)
        ├── UnknownEventError(LookupError)    no event by that id (or not listed for that VM)
        ├── InvalidEventError(ValueError)     an event that cannot be created
        ├── EventStateError(ValueError)       a step its state forbids (cancel a Started one)
        └── ScenarioError(ValueError)         a scenario file that does not load or validate
"""

from __future__ import annotations

from schemas import ConfigError as RelayConfigError
from schemas import RelayError

__all__ = [
    "ConfigError",
    "DuplicateVmError",
    "EventStateError",
    "InvalidEventError",
    "InvalidVmNameError",
    "ScenarioError",
    "SimulatorError",
    "UnknownEventError",
    "UnknownVmError",
    "describe_validation_error",
]


class SimulatorError(RelayError):
    """Root of every error the simulator raises on purpose."""


class ConfigError(SimulatorError, RelayConfigError):
    """A setting is out of range or malformed."""


class UnknownVmError(SimulatorError, LookupError):
    """No VM by that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown VM {name!r}")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateVmError(SimulatorError, ValueError):
    """A VM by that name exists already."""


class InvalidVmNameError(SimulatorError, ValueError):
    """A name that cannot be a VM's: letters, digits, '.', '_' and '-' only."""


class UnknownEventError(SimulatorError, LookupError):
    """No event by that id, or the event does not list the VM that asked."""

    def __init__(self, event_id: str, vm: str | None = None) -> None:
        where = "" if vm is None else f" for VM {vm!r}"
        super().__init__(f"unknown EventId {event_id!r}{where}")
        self.event_id = event_id
        self.vm = vm

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidEventError(SimulatorError, ValueError):
    """The event cannot be created as described."""


class EventStateError(SimulatorError, ValueError):
    """The event's state does not allow that step."""


class ScenarioError(SimulatorError, ValueError):
    """A scenario does not load or does not validate; the message names the bad field."""


def describe_validation_error(exc: Exception, *, prefix: str = "") -> str:
    """One line per problem, each naming the field: ``actions[2].event.EventType: Field required``.

    ``exc`` is a pydantic ``ValidationError``; anything else is rendered with ``str``.
    """
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return f"{prefix}: {exc}" if prefix else str(exc)
    lines = []
    for error in errors(include_url=False):
        where = prefix
        for part in error.get("loc", ()):
            if isinstance(part, int):
                where += f"[{part}]"
            else:
                where += f".{part}" if where else str(part)
        message = str(error.get("msg", "invalid"))
        message = message.removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)
