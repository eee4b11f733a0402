"""The agent's settings: one typed object, built once at the edge.

Precedence, highest first: command-line flags, environment variables
``SCHEDULED_EVENTS_<NAME>`` (``SCHEDULED_EVENTS_POLL_INTERVAL=0.5``: the same scheme as the
central services'), the TOML file given by ``--config`` / ``SCHEDULED_EVENTS_CONFIG`` (keys are
the setting names, ``poll_interval = 0.5``), then the defaults. Everything inside the agent takes
:class:`AgentSettings`; nothing else reads ``os.environ``. Secrets may come from files
(``--broker-file``: the broker URL, for systemd's ``LoadCredential=``).

There is no default broker: an agent started without one refuses to start (``memory://`` only
when named: a publish there with nobody listening is lost).

>>> settings = AgentSettings(imds_url="http://127.0.0.1:8080/vm/web-7", broker="memory://demo")
>>> settings.poll_interval
1.0
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from schemas import (
    API_VERSIONS,
    DEFAULT_API_VERSION,
    LIVENESS_PER_HEARTBEAT,
    MAX_HEARTBEAT_INTERVAL,
    ConfigError,
)
from schemas._files import read_setting_text
from schemas.channels import DEFAULT_CHANNELS, ChannelNames
from schemas.transitions import TransitionKind
from schemas.transport import broker_kind, redact
from schemas.transport._amqp_settings import parse_amqp_url

__all__ = ["ENV_PREFIX", "AgentSettings", "HookSpec", "parse_settings"]

ENV_PREFIX = "SCHEDULED_EVENTS_"
DEFAULT_STATE_DIR = Path("/var/lib/scheduled-events-agent")
#: The largest ``approval_max_lifetime``: a day. An approval answers an event IMDS announces
#: minutes ahead (15 for most kinds), so a longer life only widens the window for a replay; and
#: past about 2.5e11 s, ``issued_at`` plus the lifetime is no date at all.
MAX_APPROVAL_LIFETIME = 86_400.0
#: The shortest heartbeat interval the agent takes (seconds): a shorter one is a mistake that
#: every consumer group pays for, once per VM.
MIN_HEARTBEAT_INTERVAL = 1.0
#: The largest settings file read (far more than any holds) and the largest secret file (a
#: connection string is a few hundred bytes): a larger one, or a device that never ends
#: (``/dev/zero``), is refused unread.
MAX_CONFIG_FILE = 1024 * 1024
MAX_SECRET_FILE = 64 * 1024
#: What a channel suffix may be: it ends up in every entity name, and those of RabbitMQ and
#: Service Bus alike take letters, digits, ``.``, ``-`` and ``_``.
_SUFFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")


#: The longest hook command taken: every result of a hook names its command, and the agent's
#: state stores it with each run.
MAX_HOOK_COMMAND = 4096


@dataclass(frozen=True, slots=True)
class HookSpec:
    """A local command run on chosen transitions: ``started,scheduled=/usr/local/bin/drain``."""

    on: frozenset[TransitionKind]
    command: str

    @classmethod
    def parse(cls, text: str) -> HookSpec:
        kinds, sep, command = text.partition("=")
        if not sep or not command.strip():
            raise ConfigError(f"hook {text!r}: expected KIND[,KIND...]=COMMAND")
        try:
            on = frozenset(TransitionKind(k.strip()) for k in kinds.split(",") if k.strip())
        except ValueError as exc:
            known = ", ".join(k.value for k in TransitionKind)
            raise ConfigError(f"hook {text!r}: transitions are among {known}") from exc
        if not on:
            raise ConfigError(f"hook {text!r}: name at least one transition")
        command = command.strip()
        # The hook runner splits the command as a shell would (shlex) and runs it without a
        # shell: a command it cannot split, or one that leaves nothing to run, is refused here,
        # where the operator sees it, not at the first event that runs it.
        if "\0" in command:
            raise ConfigError(f"hook {text!r}: the command holds a NUL character")
        if len(command) > MAX_HOOK_COMMAND:
            raise ConfigError(
                f"hook {text[:60]!r}...: the command is {len(command)} characters long; at most "
                f"{MAX_HOOK_COMMAND} (put a longer one in a script)"
            )
        try:
            command.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A byte of another encoding on the command line, kept by Python as a lone
            # surrogate: the state store could not save the hook's runs, and the agent ended at
            # the first transition.
            raise ConfigError(
                f"hook {text!r}: the command is not UTF-8 text ({exc.reason} at {exc.start})"
            ) from exc
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise ConfigError(
                f"hook {text!r}: the command cannot be split into words ({exc}): close every "
                "quote, or escape it with a backslash"
            ) from exc
        if not argv or not argv[0]:
            raise ConfigError(f"hook {text!r}: the command names no program to run")
        return cls(on=on, command=command)

    def __str__(self) -> str:
        return f"{','.join(sorted(self.on))}={self.command}"


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything the agent can be told. Validated on construction (:class:`ConfigError`
    naming the setting)."""

    #: Base URL; the agent appends ``/metadata/...`` (a simulator VM: ``http://H:P/vm/NAME``).
    imds_url: str = "http://169.254.169.254"
    api_version: str = DEFAULT_API_VERSION
    instance_api_version: str = "2021-02-01"
    #: ``amqp://`` / ``amqps://`` (RabbitMQ), a Service Bus address, ``memory://NAME``
    #: (in-process). Required.
    broker: str = ""
    #: Where the SQLite state lives; None keeps it in memory (nothing survives the process).
    state_dir: Path | None = DEFAULT_STATE_DIR
    poll_interval: float = 1.0
    #: Poll interval while something is seconds away (an event of this VM runs or was approved
    #: here, a NotBefore is near).
    fast_poll_interval: float = 0.5
    #: The longest polling stays fast after an event started or an approval was applied (it
    #: slows down at once when that event is gone).
    fast_poll_seconds: float = 10.0
    #: Poll fast when a Scheduled event's NotBefore is closer than this.
    not_before_lead_seconds: float = 15.0
    #: IMDS allows 5 requests per second per VM, for every client on it together: the agent
    #: takes at most this many in any one-second window (GET and POST alike).
    imds_max_rps: int = 2
    #: The whole of one IMDS request (connect, send, every byte of the answer).
    imds_timeout: float = 5.0
    #: The very first call may take up to two minutes while IMDS enables the service.
    imds_first_timeout: float = 120.0
    #: The largest IMDS answer taken, in bytes.
    imds_max_body: int = 1024 * 1024
    #: An older document (lower incarnation) is accepted only after this many polls...
    stale_polls: int = 3
    #: ...over at least this many seconds (a real reset of IMDS, not a lagging answer).
    stale_seconds: float = 10.0
    trust_keys: tuple[Path, ...] = ()
    accept_unsigned_approvals: bool = False
    #: The longest an approval is accepted after it was issued, whatever its expiry says.
    approval_max_lifetime: float = 3600.0
    dry_run: bool = False
    all_events: bool = False
    #: Local port for /metrics and /healthz; None: no server, 0: any free port.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_format: str = "text"
    log_level: str = "INFO"
    #: An ``agent.heartbeat`` goes once this long went by without any other message. Every
    #: message of the agent's own says so, and consumers count it live for 2.5 of these (at
    #: least their own timeout): at most an hour.
    heartbeat_interval: float = 60.0
    #: Outbox bound in messages. Heartbeats are dropped first; transitions and every other
    #: message are never dropped (the outbox grows past the bound, and says so loudly).
    outbox_limit: int = 10_000
    #: How long SIGTERM / stop() waits for the outbox to drain before giving up.
    drain_timeout: float = 10.0
    publish_timeout: float = 10.0
    hooks: tuple[HookSpec, ...] = ()
    hook_timeout: float = 60.0
    #: Run a hook cut off by a crash again (for hooks safe to repeat); else report it
    #: ``interrupted``.
    hook_rerun_interrupted: bool = False
    #: ``always``: consume approvals all the time; ``pending``: only while an event of this VM
    #: is Scheduled (no broker link for approvals the rest of the time); ``auto``: ``pending``
    #: on Service Bus (connections are counted there), ``always`` elsewhere.
    approvals_listen: str = "auto"
    #: /healthz answers 503 once the broker or IMDS has been failing for this long.
    health_grace: float = 30.0
    #: Sign every lifecycle message with an Azure-attested key of this VM's (see
    #: :mod:`schemas.origin`): ``auto`` (on Service Bus, where the broker names no sender),
    #: ``on`` or ``off``.
    sign_messages: str = "auto"
    #: Broker entity names (tests give each run names of its own).
    channels: ChannelNames = field(default=DEFAULT_CHANNELS)

    def __post_init__(self) -> None:
        _check_url("imds_url", self.imds_url)
        _check_broker(self.broker)
        if self.state_dir is not None:
            _check_path("state_dir", self.state_dir)
        if not self.metrics_host.isprintable():
            raise ConfigError(
                f"metrics_host must be a host name or address, got {self.metrics_host!r}"
            )
        if self.api_version not in API_VERSIONS:
            raise ConfigError(
                f"api_version {self.api_version!r} is not one of {', '.join(API_VERSIONS)}"
            )
        for name in (
            "poll_interval",
            "fast_poll_interval",
            "imds_timeout",
            "imds_first_timeout",
            "heartbeat_interval",
            "drain_timeout",
            "publish_timeout",
            "hook_timeout",
            "approval_max_lifetime",
            "stale_seconds",
            "health_grace",
        ):
            _check_positive(name, getattr(self, name))
        if self.heartbeat_interval < MIN_HEARTBEAT_INTERVAL:
            raise ConfigError(
                f"heartbeat_interval must be at least {MIN_HEARTBEAT_INTERVAL:g} s, got "
                f"{self.heartbeat_interval!r}: every heartbeat of every VM goes to every "
                "consumer group (a typo of 0.06 for 60 would be a thousand times the load)"
            )
        if self.heartbeat_interval > MAX_HEARTBEAT_INTERVAL:
            raise ConfigError(
                f"heartbeat_interval must be at most {MAX_HEARTBEAT_INTERVAL:.0f} s (an hour), "
                f"got {self.heartbeat_interval!r}: consumers count an agent live for "
                f"{LIVENESS_PER_HEARTBEAT:g} heartbeat intervals, and the contract bounds what "
                "an agent may declare"
            )
        if self.approval_max_lifetime > MAX_APPROVAL_LIFETIME:
            raise ConfigError(
                f"approval_max_lifetime must be at most {MAX_APPROVAL_LIFETIME:.0f} s (a day), got "
                f"{self.approval_max_lifetime!r}: an approval answers an event announced minutes "
                "ahead"
            )
        for name in ("fast_poll_seconds", "not_before_lead_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if not 1 <= self.imds_max_rps <= 5:
            raise ConfigError(
                f"imds_max_rps must be 1..5 (the IMDS limit), got {self.imds_max_rps}"
            )
        if self.stale_polls < 1:
            raise ConfigError(f"stale_polls must be >= 1, got {self.stale_polls}")
        if self.imds_max_body < 1024:
            raise ConfigError(
                f"imds_max_body must be at least 1024 bytes, got {self.imds_max_body}"
            )
        if self.sign_messages not in ("auto", "on", "off"):
            raise ConfigError(f"sign_messages must be auto, on or off, got {self.sign_messages!r}")
        if self.approvals_listen not in ("auto", "always", "pending"):
            raise ConfigError(
                f"approvals_listen must be auto, always or pending, got {self.approvals_listen!r}"
            )
        if self.outbox_limit < 1:
            raise ConfigError(f"outbox_limit must be >= 1, got {self.outbox_limit}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        for path in self.trust_keys:
            _check_path("trust_keys", path)
            if not path.is_file():
                raise ConfigError(f"trust_keys: {path} is not a readable file")
        if self.trust_keys and self.accept_unsigned_approvals:
            raise ConfigError(
                "accept_unsigned_approvals: refused together with trust_keys: with trusted keys "
                "an unsigned approval is never applied; drop one of the two"
            )

    @property
    def listens_always(self) -> bool:
        """Whether the approvals are consumed all the time (see ``approvals_listen``)."""
        if self.approvals_listen == "auto":
            return broker_kind(self.broker) != "servicebus"
        return self.approvals_listen == "always"

    @property
    def signs(self) -> bool:
        """Whether messages carry a signed origin (see ``sign_messages``)."""
        if self.sign_messages == "auto":
            return broker_kind(self.broker) == "servicebus"
        return self.sign_messages == "on"

    @property
    def observe_only(self) -> bool:
        """No trusted key and unsigned approvals refused: every approval is refused."""
        return not self.trust_keys and not self.accept_unsigned_approvals

    def summary(self) -> dict[str, Any]:
        """The settings without secrets, for ``agent.online`` and the start-up log."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "broker":
                value = redact(value)
            elif f.name == "channels":
                value = {"events_exchange": value.events_exchange, "vm_prefix": value.vm_prefix}
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = [str(v) for v in value]
            out[f.name] = value
        return out


def _check_url(name: str, value: str) -> None:
    """An http(s) URL the agent can send requests to, checked whole now: the HTTP client takes
    it apart only at the first request (a port that is no number was a traceback there), and
    puts its path in the request line as it is."""
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise ConfigError(
            f"{name} must be printable ASCII without spaces (percent-encode the rest), "
            f"got {value!r}"
        )
    try:
        split = urlsplit(value)
        port = split.port
    except ValueError as exc:
        raise ConfigError(f"{name} is not a URL ({exc}), got {value!r}") from exc
    if split.scheme not in ("http", "https") or not split.hostname:
        raise ConfigError(f"{name} must be an http:// URL, got {value!r}")
    if split.username is not None or split.password is not None:
        # Not repeated: the password would be in the log.
        raise ConfigError(f"{name} must carry no user or password (IMDS asks for none)")
    if port == 0:
        raise ConfigError(f"{name}: port 0 is no port to ask (1 to 65535), got {value!r}")
    if "?" in value or "#" in value:
        raise ConfigError(
            f"{name} must have no ?query or #fragment (the agent appends /metadata/... to it), "
            f"got {value!r}"
        )


def _check_broker(broker: str) -> None:
    """A broker address the transport can use: its kind, its form and (RabbitMQ) its options,
    checked now rather than when the agent first connects (a URL that was no URL raised
    ValueError here; a bad port or option was refused only after IMDS had answered). Nothing
    said here repeats a password."""
    text = broker.strip()
    if not text:
        raise ConfigError(
            f"broker: none given: pass --broker URL (or --broker-file FILE, or set "
            f"{ENV_PREFIX}BROKER); memory://NAME only for a test in one process"
        )
    if not text.isprintable():
        raise ConfigError("broker: the address holds a control character")
    try:
        kind = broker_kind(text)
        if text.lower().startswith("endpoint="):
            # A Service Bus connection string: its Endpoint is the URL to check.
            parts = (p.partition("=") for p in text.split(";"))
            url = next((v.strip() for k, _, v in parts if k.strip().lower() == "endpoint"), "")
        else:
            url = text
        split = urlsplit(url)
        split.port  # noqa: B018 - a port that is no number or out of range raises
    except ConfigError as exc:
        raise ConfigError(f"broker: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"broker: {_redacted(text)} is not a URL ({exc})") from exc
    if kind == "rabbitmq":
        try:
            parse_amqp_url(text)
        except ConfigError as exc:
            raise ConfigError(f"broker: {exc}") from exc
    elif kind == "servicebus" and not (split.netloc or split.path):
        raise ConfigError(f"broker: {_redacted(text)} names no Service Bus namespace")


def _redacted(url: str) -> str:
    """The address, quoted, without its secrets (:func:`redact`); when it cannot be taken apart
    to find them, only its scheme."""
    try:
        return repr(redact(url))
    except ValueError:
        scheme, sep, _ = url.partition("://")
        return f"the {scheme}:// address" if sep else "the address"


def _check_path(name: str, path: Path) -> None:
    # Only a TOML file can give one: flags and environment variables cannot hold a NUL.
    if "\0" in str(path):
        raise ConfigError(f"{name}: {str(path)!r} holds a NUL character: no file has that name")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


# --------------------------------------------------------------------------- flags, env, TOML


def _bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _number(kind: type[int] | type[float], name: str, value: object) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        return kind(str(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be a number, got {value!r}") from exc


def _list(value: object) -> list[str]:
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return [part for part in str(value).split(",") if part.strip()]


def _coerce(name: str, value: object) -> Any:
    """A raw value from TOML, the environment or a flag, as the field's type."""
    if name in ("accept_unsigned_approvals", "dry_run", "all_events", "hook_rerun_interrupted"):
        return _bool(name, value)
    if name in ("imds_max_rps", "outbox_limit", "stale_polls", "imds_max_body"):
        return _number(int, name, value)
    if name == "metrics_port":
        return (
            None if str(value).strip().lower() in ("", "none", "off") else _number(int, name, value)
        )
    if name == "state_dir":
        return None if str(value).strip().lower() in ("", ":memory:") else Path(str(value))
    if name == "trust_keys":
        return tuple(
            Path(p.strip())
            for p in (value if isinstance(value, list | tuple) else str(value).split(","))
            if str(p).strip()
        )
    if name == "hooks":
        # In the environment several hooks are separated by ";" (commands may hold commas).
        items = value if isinstance(value, list | tuple) else str(value).split(";")
        return tuple(HookSpec.parse(str(h)) for h in items if str(h).strip())
    if name in ("channel_suffix", "broker_file"):
        return str(value)
    if name in _FLOATS:
        return _number(float, name, value)
    return str(value)


_FLOATS = {f.name for f in fields(AgentSettings) if f.type in ("float", float)}
_SETTABLE = {f.name for f in fields(AgentSettings) if f.name != "channels"} | {
    "channel_suffix",
    "broker_file",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scheduled-events-agent",
        description=(
            "Watch Azure IMDS Scheduled Events, publish every transition, apply signed approvals. "
            f"Every flag can also be set as an environment variable {ENV_PREFIX}<NAME> or in the "
            "TOML file given by --config (key = the flag name with underscores)."
        ),
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE", help="TOML settings file (lowest precedence)")
    p.add_argument("--imds-url", help="IMDS base URL (default http://169.254.169.254)")
    p.add_argument(
        "--api-version", help=f"Scheduled Events api-version (default {DEFAULT_API_VERSION})"
    )
    p.add_argument(
        "--instance-api-version", help="instance metadata api-version (default 2021-02-01)"
    )
    p.add_argument(
        "--broker",
        help="amqp://USER:PASS@HOST/VHOST, amqps://..., a Service Bus connection string or "
        "sb://NAMESPACE, or memory://NAME (one process); required",
    )
    p.add_argument(
        "--broker-file",
        metavar="FILE",
        help="read the broker URL from FILE (its first line): keeps the secret out of the "
        "command line and the environment (systemd LoadCredential=)",
    )
    p.add_argument(
        "--state-dir",
        help=f"SQLite state directory (default {DEFAULT_STATE_DIR}); it records its VM, and a "
        "state another VM wrote (a disk or image cloned from it) is moved aside, never used",
    )
    p.add_argument("--poll-interval", help="seconds between polls when idle (default 1)")
    p.add_argument("--fast-poll-interval", help="seconds between polls while busy (default 0.5)")
    p.add_argument(
        "--fast-poll-seconds",
        help="the longest polling stays fast after an event of this VM started or an approval "
        "was applied; it slows down as soon as that event has ended (default 10)",
    )
    p.add_argument(
        "--not-before-lead-seconds", help="poll fast this close to a NotBefore (default 15)"
    )
    p.add_argument(
        "--imds-max-rps",
        help="IMDS requests in any one-second window, all kinds, at most (1..5, default 2: the "
        "VM's 5 per second are shared with every other client on it)",
    )
    p.add_argument("--imds-timeout", help="seconds for the whole of one IMDS request (default 5)")
    p.add_argument("--imds-max-body", help="largest IMDS answer taken, bytes (default 1048576)")
    p.add_argument(
        "--stale-polls",
        help="an older IMDS document is accepted only after this many polls (default 3)",
    )
    p.add_argument("--stale-seconds", help="...over at least this many seconds (default 10)")
    p.add_argument(
        "--imds-first-timeout", help="seconds for the very first IMDS request (default 120)"
    )
    p.add_argument(
        "--trust-key",
        dest="trust_keys",
        action="append",
        metavar="FILE",
        help="Ed25519 public key whose approvals are trusted (repeatable)",
    )
    p.add_argument(
        "--accept-unsigned-approvals",
        action="store_const",
        const=True,
        help="apply approvals without a signature (unsafe; for trusted brokers only)",
    )
    p.add_argument(
        "--approval-max-lifetime",
        metavar="SECONDS",
        help="refuse an approval this long after it was issued, whatever its expiry says "
        "(at most 86400; default 3600)",
    )
    p.add_argument(
        "--dry-run",
        action="store_const",
        const=True,
        help="verify and report approvals but never POST them to IMDS",
    )
    p.add_argument(
        "--all-events",
        action="store_const",
        const=True,
        help="publish events of every VM in the document, not only this VM's",
    )
    p.add_argument("--metrics-port", help="port for /metrics and /healthz (0: any; default off)")
    p.add_argument("--metrics-host", help="address for /metrics and /healthz (default 127.0.0.1)")
    p.add_argument("--log-format", help="text or json (default text)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument(
        "--heartbeat-interval",
        help="an agent.heartbeat once this many seconds went by without any other message "
        f"(default 60, at least {MIN_HEARTBEAT_INTERVAL:g}, at most {MAX_HEARTBEAT_INTERVAL:.0f}). "
        "Any message says the agent is "
        "alive, and each of its own messages says this interval: consumers count the agent "
        f"live for {LIVENESS_PER_HEARTBEAT:g} of them (or their own timeout, 150 s by default, "
        "if longer)",
    )
    p.add_argument("--outbox-limit", help="outbox bound; heartbeats dropped first (default 10000)")
    p.add_argument("--drain-timeout", help="seconds to drain the outbox on stop (default 10)")
    p.add_argument("--publish-timeout", help="seconds to wait for a broker confirm (default 10)")
    p.add_argument(
        "--hook",
        dest="hooks",
        action="append",
        metavar="KINDS=COMMAND",
        help="run COMMAND on these transitions, e.g. started=/usr/local/bin/drain (repeatable); "
        "a run left from before a restart executes only if its command is still configured for "
        "its transition (else it is reported not-started)",
    )
    p.add_argument("--hook-timeout", help="seconds a hook may run (default 60)")
    p.add_argument(
        "--hook-rerun-interrupted",
        action="store_const",
        const=True,
        help="run a hook cut off by a crash again (for hooks safe to repeat); else it is "
        "reported as interrupted",
    )
    p.add_argument(
        "--approvals-listen",
        help="always, pending (only while an event of this VM is Scheduled) or auto (pending on "
        "Service Bus, always elsewhere; the default)",
    )
    p.add_argument(
        "--sign-messages",
        help="auto (on Service Bus), on or off: sign every message with a key of this VM's "
        "that Azure attests (IMDS attested data), so consumers know it is this VM's",
    )
    p.add_argument(
        "--health-grace",
        help="/healthz answers 503 once the broker or IMDS has failed this long (default 30)",
    )
    p.add_argument("--channel-suffix", help="suffix for every broker entity name (tests)")
    return p


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentSettings:
    """Settings from flags > environment > TOML file > defaults; :class:`ConfigError` naming
    the setting when one is invalid. ``--help`` exits through argparse."""

    env = os.environ if environ is None else environ
    flags = vars(_parser().parse_args(argv))
    config_path = flags.pop("config", None) or env.get(f"{ENV_PREFIX}CONFIG")
    raw: dict[str, object] = {}
    if config_path:
        raw.update(_read_toml(Path(config_path)))
    for name in _SETTABLE:
        key = ENV_PREFIX + name.upper()
        if key in env:
            raw[name] = env[key]
    raw.update(flags)
    values: dict[str, Any] = {}
    for name, value in raw.items():
        values[name] = _coerce(name, value)
    suffix = values.pop("channel_suffix", None)
    if suffix:
        if not _SUFFIX.fullmatch(suffix):
            raise ConfigError(
                f"channel_suffix must be 1 to 64 letters, digits, '.', '-' or '_', got {suffix!r}"
            )
        values["channels"] = DEFAULT_CHANNELS.suffixed(suffix)
    broker_file = values.pop("broker_file", None)
    if broker_file:
        if values.get("broker"):
            raise ConfigError("broker: give --broker or --broker-file, not both")
        values["broker"] = _read_secret(Path(broker_file), "broker_file")
    return AgentSettings(**values)


def _read_text(path: Path, name: str, limit: int) -> str:
    """A small UTF-8 file, whole: :class:`ConfigError` naming the setting for anything else
    (not there, not a regular file, over ``limit`` bytes, not UTF-8). Opened without blocking
    (a FIFO nobody writes to held the start for ever) and read at most ``limit`` bytes (a link
    to ``/dev/zero`` was read until memory ran out). Says nothing of the content: it may be a
    secret."""
    _check_path(name, path)
    try:
        return read_setting_text(path, limit, "", encoding="utf-8-sig")
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from exc


def _read_secret(path: Path, name: str) -> str:
    lines = _read_text(path, name, MAX_SECRET_FILE).strip().splitlines()
    if not lines or not lines[0].strip():
        raise ConfigError(f"{name}: {path} is empty")
    return lines[0].strip()


def _read_toml(path: Path) -> dict[str, object]:
    text = _read_text(path, "config", MAX_CONFIG_FILE)
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        # TOMLDecodeError is a ValueError; so is an integer of more than 4,300 digits, and
        # brackets nested deeper than Python recurses raise RecursionError.
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError(f"config: {path} is not valid TOML: {why}") from exc
    out: dict[str, object] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        name = {"trust_key": "trust_keys", "hook": "hooks"}.get(name, name)
        if name not in _SETTABLE:
            raise ConfigError(f"config: {path} has an unknown setting {key!r}")
        out[name] = value
    return out
