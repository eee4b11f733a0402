"""The whole system in one test's event loop, for the console: the IMDS simulator over HTTP,
real agents, the approver and the audit on one SQLite database, and the console on its own
connection to it, all over one in-memory broker. The console signs with a key of its own,
which the agents trust beside the approver's."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumers import PolicySet
from consumers._approver import ApproverService
from consumers._audit import Ledger, open_ledger
from consumers._audit_service import AuditService
from consumers._db import open_database
from consumers.console._auth import Authenticator
from consumers.console._server import ConsoleServer, console_running
from consumers.console._service import ConsoleService
from consumers.console._sessions import SessionCodec
from consumers.console._users import Role, UsersFile, write_user
from publisher import Agent, AgentSettings, HookSpec
from publisher.simulator import Simulator, SimulatorConfig, SimulatorServer, serve
from schemas import DEFAULT_CHANNELS, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport import MemoryBroker, Transport, open_transport

#: Operators' passwords in tests (few PBKDF2 rounds: the format is the same).
PASSWORDS = {"alice": "alice-password", "victor": "victor-password"}
ROLES = {"alice": Role.OPERATOR, "victor": Role.VIEWER}


def write_users(path: Path) -> Path:
    for name, password in PASSWORDS.items():
        write_user(path, name, ROLES[name], password, iterations=1000)
    return path


@dataclass
class Stack:
    simulator: Simulator
    imds: SimulatorServer
    console: ConsoleService
    server: ConsoleServer
    ledger: Ledger
    approver: ApproverService
    transport: Transport
    agents: list[Agent] = field(default_factory=list)
    _start_approver: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return self.server.url

    def start_approver(self) -> None:
        self._start_approver.set()

    async def decisions(self, event_id: str) -> list[dict[str, Any]]:
        return [
            e.body for e in await self.ledger.history(event_id=event_id) if e.record == "decision"
        ]


def _agent(imds: SimulatorServer, vm: str, broker: str, keys, hooks) -> Agent:
    return Agent(
        AgentSettings(
            imds_url=imds.vm_url(vm),
            broker=broker,
            state_dir=None,
            trust_keys=keys,
            poll_interval=0.2,
            fast_poll_interval=0.1,
            heartbeat_interval=5.0,
            drain_timeout=3.0,
            channels=DEFAULT_CHANNELS,
            hooks=hooks,
            log_level="WARNING",
        )
    )


@contextlib.asynccontextmanager
async def running_stack(
    tmp_path: Path,
    vms: tuple[str, ...] = ("web_0", "web_1", "web_2"),
    *,
    policies: PolicySet | None = None,
    hooks: tuple[str, ...] = (),
    approver_first: bool = True,
    audit: bool = True,
    signing_key: bool = True,
) -> AsyncIterator[Stack]:
    """The stack; ``approver_first`` False: the approver's group collects messages, and the
    approver starts at :meth:`Stack.start_approver`. ``audit`` False: no audit service."""
    name = f"console-{uuid.uuid4().hex[:8]}"
    broker = f"memory://{name}"
    _, approver_pub = write_key_pair(tmp_path / "approver")
    _, console_pub = write_key_pair(tmp_path / "console")
    approver_key = load_signing_key(tmp_path / "approver" / "approver.key")
    console_key = load_signing_key(tmp_path / "console" / "approver.key")
    simulator = Simulator(SimulatorConfig(speed=1, rate_limit=0), vms=list(vms))
    db_path = tmp_path / "central.db"
    auth = Authenticator(SessionCodec(b"k" * 32), users=UsersFile(write_users(tmp_path / "users")))
    try:
        async with (
            serve(simulator) as imds,
            open_ledger(str(db_path)) as ledger,
            open_transport(broker) as approver_link,
            open_transport(broker) as audit_link,
            open_transport(broker) as console_link,
            open_database(str(db_path)) as console_db,
            console_running(
                console_link,
                console_db,
                auth,
                signing_key=console_key if signing_key else None,
            ) as (console, server),
        ):
            await approver_link.declare_group("approver", exclusive=True)
            approver = ApproverService(approver_link, approver_key, policies, db=ledger.db)
            auditor = AuditService(audit_link, ledger)
            stack = Stack(simulator, imds, console, server, ledger, approver, console_link)
            if approver_first:
                stack.start_approver()
            parsed = tuple(HookSpec.parse(h) for h in hooks)
            stack.agents = [
                _agent(imds, vm, broker, (approver_pub, console_pub), parsed) for vm in vms
            ]
            async with asyncio.TaskGroup() as tasks:

                async def approve_later() -> None:
                    await stack._start_approver.wait()
                    await approver.run()

                services = [tasks.create_task(approve_later())]
                if audit:
                    services.append(tasks.create_task(auditor.run()))
                runs = [tasks.create_task(agent.run()) for agent in stack.agents]
                try:
                    async with asyncio.timeout(20):
                        for agent in stack.agents:
                            await agent.started()
                    yield stack
                finally:
                    for agent in stack.agents:
                        agent.stop("test over")
                    async with asyncio.timeout(10):
                        await asyncio.gather(*runs, return_exceptions=True)
                    approver.stop()
                    auditor.stop()
                    for task in services:
                        task.cancel()
    finally:
        MemoryBroker.discard(name)
