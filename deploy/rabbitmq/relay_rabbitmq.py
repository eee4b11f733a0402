#!/usr/bin/env python3
"""Broker identities with least privilege for scheduled-events-relay, on RabbitMQ.

Creates, in one vhost, the users of the relay and exactly the permissions each needs, with
``rabbitmqctl`` (so it runs on a broker node where the management plugin is off; run it as a
user that may run rabbitmqctl, usually root or rabbitmq):

=============  ================================================================================
role           may
=============  ================================================================================
vm NAME        publish lifecycle messages whose routing key ends in its own VM's name (topic
               permission ``^[^.]+\\.[^.]+\\.{username}$``), consume its own approvals queue
               ``scheduled-events.vm.<username>``; never publish an approval, never read another
               VM's queue or the fleet stream. The user is the VM's name as the routing keys
               spell it (lower case, ``.``/``*``/``#``/spaces as ``_``): ``Web.7`` -> ``web_7``
scale-set NAME the same for every VM of a scale set (``NAME_0``, ``NAME_1``, ...): one user,
               ``NAME`` in lower case, for keys ending in ``{username}_<n>``
approver USER  publish approvals, consume its group (``scheduled-events.group.approver``);
               never publish a lifecycle message
audit USER     consume its group (``scheduled-events.group.audit``); publish nothing but its
               own dead letters
tail USER      read the live stream through ``tail``'s transient queues
=============  ================================================================================

The central roles may also declare the shared exchanges (the relay's parties each declare what
they use); VMs and scale sets may not: their agents connect with ``declare=passive`` and only
check that the exchanges are there, so start a central service (approver or audit) first.

Passwords never appear on a command line or in the output: they come from a file
(``--password-file``), standard input (``--password-stdin``) or a directory of one file per
user (``--passwords-dir``, where a missing file is created with a new random password, mode
0600), and reach rabbitmqctl on its standard input. Running it again sets the same state
(idempotent): existing users get their password and permissions set again.

For thousands of VMs, ``--bulk`` applies everything in one ``rabbitmqctl import_definitions``
(salted SHA-256 password hashes, as RabbitMQ stores them) instead of four calls per user.

    relay_rabbitmq.py vhost --vhost relay
    relay_rabbitmq.py vm --vhost relay --passwords-dir /root/relay-passwords web-7 web-8
    relay_rabbitmq.py scale-set --vhost relay --passwords-dir /root/relay-passwords WestNO
    relay_rabbitmq.py approver --vhost relay --password-file approver.pw relay-approver
    relay_rabbitmq.py audit --vhost relay --password-stdin relay-audit < audit.pw
    relay_rabbitmq.py show --vhost relay
    relay_rabbitmq.py delete-users --vhost relay web-7 web-8
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The contract's entity names (schemas/channels.py).
EVENTS = "scheduled-events"
APPROVALS = "scheduled-events.vm-approvals"
UNROUTED = "scheduled-events.unrouted"
GROUP_PREFIX = "scheduled-events.group."
VM_PREFIX = "scheduled-events.vm."
DEAD_LETTER = ".dead-letter"
TRANSIENT = ".transient."

#: A lifecycle routing key is ``<type>.<EventType>.<vm>``: three words, the VM's name last.
_KEY_HEAD = r"^[^.]+\.[^.]+\."
VM_KEYS = _KEY_HEAD + r"{username}$"
SCALE_SET_KEYS = _KEY_HEAD + r"{username}_[0-9]+$"
#: A regex that matches no routing key at all, not even the empty one ("#" would route that).
NOTHING = "(?!)"
EVERYTHING = ".*"

_WORD_UNSAFE = re.compile(r"[.#*\s]")
_REGEX_SPECIAL = re.compile(r"[.^$*+?{}\[\]\\|()]")
_TIMEOUT = 120.0
#: The largest message the broker should accept: the contract's 256 KiB body with room for its
#: properties and a dead letter's headers. RabbitMQ's own default is 128 MiB (3.x) or 16 MiB
#: (4.x), and a consumer holds up to its prefetch of messages in memory before it can refuse
#: one: 256 hostile messages of 128 MiB are 32 GiB in the approver.
MAX_MESSAGE_SIZE = 512 * 1024
#: The fewest open files the node should be allowed (its process's ``ulimit -n``): a connection
#: per agent, a file per VM's approvals queue while an approval waits in it, with room to spare.
#: At the common default of 1,024 RabbitMQ counts room for 927 files, 832 of them connections
#: (its ``sockets_limit``), the busiest process of a 2,000-VM fleet run's broker by reductions
#: was its file handle cache, and 2,000 classic queues v2 failed with ``emfile``.
MIN_OPEN_FILES = 65536
#: Beside two a VM (``vhost --vms N``): the central services' connections, the node's own files.
_OPEN_FILES_BESIDE = 1024


def open_files_needed(vms: int | None) -> int:
    """The open files the node should be allowed: :data:`MIN_OPEN_FILES` for a fleet of a size
    not given; for ``vms`` VMs two each (a connection, its approvals queue's file) and
    :data:`_OPEN_FILES_BESIDE`."""
    return MIN_OPEN_FILES if vms is None else 2 * vms + _OPEN_FILES_BESIDE


class SetupError(Exception):
    """rabbitmqctl failed, or the request makes no sense."""


def vm_word(vm: str) -> str:
    """The VM's name as the last word of its routing keys, and so its broker user: lower
    case, with ``.``, ``*``, ``#`` and spaces as ``_`` (the same as ``schemas.vm_word``)."""
    return _WORD_UNSAFE.sub("_", vm.casefold()) or "_"


def literal(name: str) -> str:
    """``name`` as a regex matching only itself (``-`` and ``_`` stay as they are, readable)."""
    return _REGEX_SPECIAL.sub(lambda found: "\\" + found.group(0), name)


def _any_of(*names: str) -> str:
    """A permission regex matching exactly these resource names (already escaped)."""
    return "^(" + "|".join(names) + ")$"


_EVENTS, _APPROVALS, _UNROUTED = (literal(n) for n in (EVENTS, APPROVALS, UNROUTED))


def _group(group: str) -> tuple[str, str]:
    queue = literal(GROUP_PREFIX + group)
    return queue, queue + literal(DEAD_LETTER)


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str
    #: exchange -> (write, read) topic permissions
    topics: dict[str, tuple[str, str]] = field(default_factory=dict)


def vm_permissions(queue_name: str, keys: str, approval_keys: str) -> Permissions:
    """A VM (or a scale set: ``queue_name`` is then a regex for its VMs' queues). Its agent
    connects with ``declare=passive``: it declares only its own queue, and may neither create
    nor delete the shared exchanges (the central services declare them)."""
    own = literal(VM_PREFIX) + queue_name
    return Permissions(
        configure=_any_of(own),
        # publish lifecycle messages (the key is checked by the topic permission below); bind
        # its own queue
        write=_any_of(_EVENTS, own),
        # bind its own queue to the approvals exchange (the binding key is checked by the topic
        # permission: its own word only), consume it
        read=_any_of(_APPROVALS, own),
        topics={EVENTS: (keys, NOTHING), APPROVALS: (NOTHING, approval_keys)},
    )


def approver_permissions(group: str) -> Permissions:
    queue, dead = _group(group)
    return Permissions(
        configure=_any_of(_EVENTS, _APPROVALS, _UNROUTED, queue, dead),
        # publish approvals and its own dead letters. The events exchange only because the
        # catch-all queue dead-letters into it (declaring it checks that): the topic
        # permission below refuses every routing key, so no lifecycle message
        write=_any_of(_EVENTS, _APPROVALS, _UNROUTED, queue, dead),
        read=_any_of(_EVENTS, _UNROUTED, queue, dead),
        topics={EVENTS: (NOTHING, EVERYTHING), APPROVALS: (EVERYTHING, NOTHING)},
    )


def audit_permissions(group: str) -> Permissions:
    queue, dead = _group(group)
    return Permissions(
        configure=_any_of(_EVENTS, _APPROVALS, _UNROUTED, queue, dead),
        # nothing but binding its own queues and publishing its own dead letters (the events
        # exchange as for the approver: the topic permission refuses every routing key)
        write=_any_of(_EVENTS, _UNROUTED, queue, dead),
        read=_any_of(_EVENTS, _UNROUTED, queue, dead),
        topics={EVENTS: (NOTHING, EVERYTHING)},
    )


def tail_permissions(group: str) -> Permissions:
    transient = literal(GROUP_PREFIX + group + TRANSIENT) + "[0-9a-f]+"
    return Permissions(
        configure=_any_of(_EVENTS, _APPROVALS, _UNROUTED, transient),
        write=_any_of(_EVENTS, _UNROUTED, transient),
        read=_any_of(_EVENTS, _UNROUTED, transient),
        topics={EVENTS: (NOTHING, EVERYTHING)},
    )


@dataclass(frozen=True)
class User:
    name: str
    role: str
    permissions: Permissions
    limits: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    name: str
    pattern: str
    definition: dict[str, object]
    apply_to: str = "queues"
    priority: int = 10


def vhost_policies(approvals_max_length: int, unrouted_max_length: int) -> list[Policy]:
    return [
        # An approver gone wild (or a VM whose agent is gone) cannot fill the broker through
        # one VM's queue; approvals expire anyway (the queue's x-message-ttl).
        Policy(
            "scheduled-events-vm-queues",
            "^" + literal(VM_PREFIX),
            {"max-length": approvals_max_length, "overflow": "reject-publish"},
        ),
        # What nobody reads yet is kept, within bounds. When it is full the broker refuses the
        # next publish (the queue's own x-overflow, reject-publish, which at-least-once
        # dead-lettering needs), so the agents keep those messages in their outboxes: nothing
        # is dropped.
        Policy(
            "scheduled-events-unrouted",
            "^" + _UNROUTED + "$",
            {"max-length": unrouted_max_length},
        ),
    ]


# ------------------------------------------------------------------------------ passwords


class Passwords:
    """Where each user's password comes from; a password is never printed."""

    def __init__(
        self,
        *,
        file: Path | None = None,
        stdin: bool = False,
        directory: Path | None = None,
    ) -> None:
        self._single: str | None = None
        self._directory = directory
        if file is not None:
            self._single = _first_line(_read_password_file(file), str(file))
        elif stdin:
            line = sys.stdin.buffer.readline(_PASSWORD_LIMIT + 1)
            self._single = _first_line(_password_text(line, "standard input"), "standard input")
        self._used_single = False

    def for_user(self, user: str) -> str:
        if self._directory is not None:
            path = self._directory / user
            if path.exists():
                return _first_line(_read_password_file(path), str(path))
            self._directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            password = secrets.token_urlsafe(32)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as out:
                out.write(password + "\n")
            return password
        if self._single is None:
            raise SetupError(
                "no password: give --password-file, --password-stdin or --passwords-dir"
            )
        if self._used_single:
            raise SetupError(
                "one --password-file/--password-stdin for several users: use --passwords-dir"
            )
        self._used_single = True
        return self._single


#: The most a password file (or standard input's first line) may hold: a password is one line.
_PASSWORD_LIMIT = 64 * 1024


def _read_password_file(path: Path) -> str:
    """The text of the password file ``path``: a regular file (a link to one, as a mounted
    secret is, is fine), UTF-8, at most :data:`_PASSWORD_LIMIT` bytes. Opened without blocking
    (a FIFO nobody writes to would hold the script for ever) and never read past the limit (a
    link to ``/dev/zero``); :class:`SetupError` for anything else. The rule of
    ``schemas/_files.py``, written here again: this script runs alone on a broker node, without
    the package."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SetupError(f"cannot read the password file {path}: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise SetupError(f"the password file {path} is not a regular file")
        with os.fdopen(descriptor, "rb", closefd=False) as opened:
            data = opened.read(_PASSWORD_LIMIT + 1)
    finally:
        os.close(descriptor)
    return _password_text(data, f"the password file {path}")


def _password_text(data: bytes, where: str) -> str:
    if len(data) > _PASSWORD_LIMIT:
        raise SetupError(f"{where} holds more than {_PASSWORD_LIMIT:,} bytes: not a password")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SetupError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _first_line(text: str, where: str) -> str:
    line = text.split("\n", 1)[0].rstrip("\r")
    if not line:
        raise SetupError(f"the password in {where} is empty")
    return line


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password))."""
    salt = salt if salt is not None else secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


# ------------------------------------------------------------------------------ rabbitmqctl


class Rabbitmqctl:
    def __init__(self, command: Sequence[str], *, dry_run: bool = False) -> None:
        self.command = list(command)
        self.dry_run = dry_run

    def run(self, *args: str, stdin: str | None = None, mutating: bool = True) -> str:
        if self.dry_run and mutating:
            shown = " ".join(args) + (" < (secret on stdin)" if stdin is not None else "")
            print(f"would run: rabbitmqctl {shown}")
            return ""
        try:
            # Never our own stdin: it may hold the password, and rabbitmqctl would read it.
            result = subprocess.run(
                [*self.command, *args],
                input=stdin if stdin is not None else "",
                capture_output=True,
                text=True,
                timeout=_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SetupError(f"rabbitmqctl {args[0]}: {exc}") from exc
        if result.returncode != 0:
            # rabbitmqctl's own messages name no password (it got it on stdin).
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise SetupError(f"rabbitmqctl {args[0]} failed: {' '.join(detail[-3:])}")
        return result.stdout

    def json(self, *args: str) -> list[dict[str, object]]:
        """A listing (``list_users``, ...) as rabbitmqctl's JSON formatter gives it: a list of
        objects (nothing printed: none). Any other answer is a :class:`SetupError` naming the
        command: what the script would do next depends on it."""
        output = self.run(*args, "--quiet", "--formatter", "json", mutating=False)
        if not output.strip():
            return []
        try:
            loaded = json.loads(output)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            loaded = exc
        if isinstance(loaded, list) and all(isinstance(row, dict) for row in loaded):
            return loaded
        shown = output.strip()[:200]
        raise SetupError(
            f"rabbitmqctl {args[0]} answered what is not a JSON list of objects ({shown!r}); "
            "the script stops here: check the rabbitmqctl command (--rabbitmqctl) and its node"
        )


def apply(ctl: Rabbitmqctl, vhost: str, users: Sequence[tuple[User, str]]) -> int:
    """Create or update each user with its password, permissions, topic permissions, limits."""
    existing = set() if ctl.dry_run else {str(u.get("user")) for u in ctl.json("list_users")}
    count = 0
    for user, password in users:
        verb = "change_password" if user.name in existing else "add_user"
        ctl.run(verb, "--", user.name, stdin=password + "\n")
        p = user.permissions
        ctl.run("set_permissions", "-p", vhost, "--", user.name, p.configure, p.write, p.read)
        for exchange, (write, read) in p.topics.items():
            ctl.run("set_topic_permissions", "-p", vhost, "--", user.name, exchange, write, read)
        if user.limits:
            ctl.run("set_user_limits", "--", user.name, json.dumps(user.limits))
        print(f"{user.role} user {user.name!r}: ready in vhost {vhost!r}")
        count += 1
    return count


def definitions(vhost: str, users: Sequence[tuple[User, str]]) -> dict[str, object]:
    """The same as :func:`apply`, as definitions for ``rabbitmqctl import_definitions``."""
    entries: list[dict[str, object]] = []
    permissions: list[dict[str, object]] = []
    topics: list[dict[str, object]] = []
    for user, password in users:
        entry: dict[str, object] = {
            "name": user.name,
            "password_hash": password_hash(password),
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": [],
        }
        if user.limits:
            entry["limits"] = dict(user.limits)
        entries.append(entry)
        p = user.permissions
        permissions.append(
            {
                "user": user.name,
                "vhost": vhost,
                "configure": p.configure,
                "write": p.write,
                "read": p.read,
            }
        )
        for exchange, (write, read) in p.topics.items():
            topics.append(
                {
                    "user": user.name,
                    "vhost": vhost,
                    "exchange": exchange,
                    "write": write,
                    "read": read,
                }
            )
    return {
        "users": entries,
        "vhosts": [{"name": vhost}],
        "permissions": permissions,
        "topic_permissions": topics,
    }


def apply_bulk(ctl: Rabbitmqctl, vhost: str, users: Sequence[tuple[User, str]]) -> int:
    document = definitions(vhost, users)
    ctl.run("import_definitions", "--format", "json", stdin=json.dumps(document))
    if not ctl.dry_run:
        _wait_imported(ctl, vhost, {user.name for user, _ in users})
    print(f"{len(users)} user(s) ready in vhost {vhost!r} (one import)")
    return len(users)


def _wait_imported(ctl: Rabbitmqctl, vhost: str, names: set[str]) -> None:
    """``import_definitions`` returns before the import is done: wait until every user has
    its permissions and topic permissions in the vhost."""
    deadline = time.monotonic() + _TIMEOUT
    while True:
        permitted = {str(p.get("user")) for p in ctl.json("list_permissions", "-p", vhost)}
        topics = {str(p.get("user")) for p in ctl.json("list_topic_permissions", "-p", vhost)}
        if names <= permitted and names <= topics:
            return
        if time.monotonic() > deadline:
            missing = sorted(names - (permitted & topics))
            raise SetupError(f"the import did not finish in {_TIMEOUT:g} s; missing: {missing}")
        time.sleep(0.5)


def ensure_vhost(ctl: Rabbitmqctl, vhost: str, policies: Sequence[Policy]) -> None:
    ctl.run("add_vhost", "--", vhost)  # a no-op when it exists
    for policy in policies:
        ctl.run(
            "set_policy",
            "-p",
            vhost,
            "--apply-to",
            policy.apply_to,
            "--priority",
            str(policy.priority),
            "--",
            policy.name,
            policy.pattern,
            json.dumps(policy.definition),
        )
    print(f"vhost {vhost!r}: ready with {len(policies)} policies")


def max_message_size_warning(ctl: Rabbitmqctl) -> str | None:
    """What to tell the operator when the broker accepts messages larger than
    :data:`MAX_MESSAGE_SIZE` (a node setting, ``rabbitmq.conf``, that no vhost can set)."""
    try:
        answer = ctl.run("eval", "application:get_env(rabbit, max_message_size).", mutating=False)
    except SetupError as exc:
        return f"could not read the broker's max_message_size ({exc})"
    found = re.fullmatch(r"\{ok,\s*(\d+)\}", answer.strip())
    if found and int(found.group(1)) <= MAX_MESSAGE_SIZE:
        return None
    size = f"{int(found.group(1)):,} bytes" if found else "its default (16 to 128 MiB)"
    return (
        f"the broker accepts messages of up to {size}; the relay's messages are at most 256 KiB, "
        "and a consumer holds up to its prefetch of messages in memory before it can refuse one"
    )


def open_files_warning(ctl: Rabbitmqctl, vms: int | None = None) -> str | None:
    """What to tell the operator when the node may hold fewer open files than
    :func:`open_files_needed` (its process's ``ulimit -n``, which no vhost or ``rabbitmq.conf``
    setting raises)."""
    try:
        status = json.loads(ctl.run("status", "--formatter", "json", mutating=False) or "{}")
        limits = status["file_descriptors"]
        total, sockets = int(limits["total_limit"]), int(limits["sockets_limit"])
    except (SetupError, ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
        # OverflowError: a limit of 1e400 (JSON's infinity); RecursionError: nesting too deep.
        return f"could not read the broker's open-files limit ({exc!r})"
    needed = open_files_needed(vms)
    if total >= needed:
        return None
    fleet = (
        "a fleet needs about two per VM (RabbitMQ's production checklist: 50,000 or more)"
        if vms is None
        else f"a fleet of {vms:,} VMs needs about {needed:,}"
    )
    return (
        f"the broker node may hold {total:,} open files, {sockets:,} of them connections: each "
        "agent holds a connection, and each VM's approvals queue a file while an approval waits "
        f"in it, so {fleet}; short of them the node has no room for more connections, and its "
        "classic queues churn their files (3.x) or fail (classic queues v2: emfile)"
    )


def _vhost_exists(ctl: Rabbitmqctl, vhost: str) -> bool:
    return any(v.get("name") == vhost for v in ctl.json("list_vhosts"))


# ------------------------------------------------------------------------------ the command


def _users(args: argparse.Namespace) -> list[User]:
    if args.command == "vm":
        limits = {"max-connections": args.max_connections, "max-channels": args.max_channels}
        return [
            User(
                vm_word(vm),
                "vm",
                vm_permissions(literal(vm_word(vm)), VM_KEYS, "^{username}$"),
                limits,
            )
            for vm in args.names
        ]
    if args.command == "scale-set":
        users = []
        for scale_set in args.names:
            queue = literal(vm_word(scale_set)) + "_[0-9]+"
            permissions = vm_permissions(queue, SCALE_SET_KEYS, "^{username}_[0-9]+$")
            users.append(User(vm_word(scale_set), "scale-set", permissions, {}))
        return users
    make = {
        "approver": approver_permissions,
        "audit": audit_permissions,
        "tail": tail_permissions,
    }[args.command]
    group = args.group or {"approver": "approver", "audit": "audit", "tail": "tail"}[args.command]
    return [User(name, args.command, make(group)) for name in args.names]


def _fleet_size(text: str) -> int:
    try:
        vms = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of VMs") from None
    if not 1 <= vms <= 10_000_000:
        raise argparse.ArgumentTypeError(f"{vms} VMs: give 1 to 10,000,000")
    return vms


#: The longest name the contract carries (a VM's in every message): ``schemas.MAX_KEY_LENGTH``.
_MAX_NAME = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _name(text: str) -> str:
    """A user's name as given (NAME, USER): not blank, no control character (a pasted newline),
    at most :data:`_MAX_NAME` characters. Anything else is a mistake the broker would take as a
    user."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a name is empty")
    if _CONTROL.search(text):
        raise argparse.ArgumentTypeError(f"name {text!r} holds a control character")
    if len(text) > _MAX_NAME:
        raise argparse.ArgumentTypeError(
            f"name {text[:40]!r}... is {len(text)} characters long: at most {_MAX_NAME}"
        )
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relay_rabbitmq.py",
        description="Create the RabbitMQ vhost, users and least-privilege permissions of "
        "scheduled-events-relay with rabbitmqctl. Idempotent; passwords never on a command "
        "line nor in the output.",
        epilog="deploy/rabbitmq/README.md explains each permission.",
    )
    parser.add_argument(
        "--rabbitmqctl",
        default="rabbitmqctl",
        metavar="COMMAND",
        help="how to run rabbitmqctl (default: rabbitmqctl; e.g. 'rabbitmqctl -n rabbit@host')",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the rabbitmqctl calls instead of running them"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--vhost", required=True, help="the relay's vhost")

    vhost = commands.add_parser(
        "vhost",
        help="create the vhost and its queue-length policies",
        description="Create the vhost and its queue-length policies, then check two settings of "
        "the node no vhost can set, and warn when either is short of a fleet's needs: the "
        f"largest message it accepts (max_message_size, at most {MAX_MESSAGE_SIZE:,} bytes) "
        f"and the open files its process may hold (ulimit -n, at least {MIN_OPEN_FILES:,}: a "
        "connection per agent and a file per VM's approvals queue).",
    )
    common(vhost)
    vhost.add_argument("--approvals-max-length", type=int, default=100, metavar="N")
    vhost.add_argument("--unrouted-max-length", type=int, default=100_000, metavar="N")
    vhost.add_argument(
        "--vms",
        type=_fleet_size,
        metavar="N",
        help="the fleet's size, for the open-files check: two files a VM and "
        f"{_OPEN_FILES_BESIDE:,} beside (default: at least {MIN_OPEN_FILES:,}, for any fleet)",
    )

    helps = {
        "vm": "one user per VM (NAME: the VM's name, as IMDS gives it)",
        "scale-set": "one user per scale set (NAME: the scale set; its VMs are NAME_<n>)",
        "approver": "approver users (publish approvals, consume their group)",
        "audit": "audit users (consume their group, publish nothing)",
        "tail": "users that may run `scheduled-events tail`",
    }
    for role, text in helps.items():
        sub = commands.add_parser(role, help=text, description=text)
        common(sub)
        sub.add_argument("names", nargs="+", metavar="NAME", type=_name)
        source = sub.add_mutually_exclusive_group(required=True)
        source.add_argument("--password-file", type=Path, metavar="FILE", help="one user")
        source.add_argument(
            "--password-stdin", action="store_true", help="one user: the first line of stdin"
        )
        source.add_argument(
            "--passwords-dir",
            type=Path,
            metavar="DIR",
            help="DIR/<user> holds each user's password; a missing one is generated (0600)",
        )
        sub.add_argument(
            "--bulk",
            action="store_true",
            help="one `rabbitmqctl import_definitions` for all the users (thousands of VMs)",
        )
        if role in ("approver", "audit", "tail"):
            sub.add_argument("--group", help=f"the consumer group (default {role})")
        if role == "vm":
            sub.add_argument(
                "--max-connections",
                type=int,
                default=3,
                metavar="N",
                help="connections one VM user may hold at once (default 3; the agent uses 1)",
            )
            sub.add_argument(
                "--max-channels",
                type=int,
                default=32,
                metavar="N",
                help="channels one VM user may hold at once (default 32)",
            )

    show = commands.add_parser("show", help="list the vhost's users and their permissions")
    common(show)
    delete = commands.add_parser("delete-users", help="delete users (their connections close)")
    common(delete)
    delete.add_argument("names", nargs="+", metavar="USER", type=_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    ctl = Rabbitmqctl(args.rabbitmqctl.split(), dry_run=args.dry_run)
    try:
        if args.command == "vhost":
            policies = vhost_policies(args.approvals_max_length, args.unrouted_max_length)
            ensure_vhost(ctl, args.vhost, policies)
            if not args.dry_run and (warning := max_message_size_warning(ctl)):
                print(
                    f"relay_rabbitmq.py: warning: {warning}: set `max_message_size = "
                    f"{MAX_MESSAGE_SIZE}` in rabbitmq.conf and restart the node (or, until its "
                    f"next restart: rabbitmqctl eval 'application:set_env(rabbit, "
                    f"max_message_size, {MAX_MESSAGE_SIZE}).')",
                    file=sys.stderr,
                )
            if not args.dry_run and (warning := open_files_warning(ctl, args.vms)):
                limit = max(open_files_needed(args.vms), MIN_OPEN_FILES)
                print(
                    f"relay_rabbitmq.py: warning: {warning}: raise the node's limit to "
                    f"{limit:,} or more (systemd: LimitNOFILE={limit} in a "
                    "drop-in for rabbitmq-server.service; else `ulimit -n` where it starts) and "
                    "restart it",
                    file=sys.stderr,
                )
        elif args.command == "show":
            for kind in ("list_permissions", "list_topic_permissions"):
                print(ctl.run(kind, "-p", args.vhost, mutating=False).rstrip())
        elif args.command == "delete-users":
            for name in args.names:
                ctl.run("delete_user", "--", name)
                print(f"user {name!r}: deleted")
        else:
            if not args.dry_run and not _vhost_exists(ctl, args.vhost):
                raise SetupError(f"no vhost {args.vhost!r}: run `relay_rabbitmq.py vhost` first")
            passwords = Passwords(
                file=args.password_file, stdin=args.password_stdin, directory=args.passwords_dir
            )
            users = [(user, passwords.for_user(user.name)) for user in _users(args)]
            (apply_bulk if args.bulk else apply)(ctl, args.vhost, users)
    except (SetupError, OSError) as exc:
        print(f"relay_rabbitmq.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
