"""Local hooks: a command run on chosen transitions, its result published as ``hook.completed``.

The command gets the event in environment variables (``EVENT_ID``, ``EVENT_TYPE``,
``EVENT_STATUS``, ``NOT_BEFORE``, ``EVENT_RESOURCES``, ``EVENT_DESCRIPTION``,
``EVENT_SOURCE``, ``EVENT_DURATION``, ``TRANSITION``, ``VM_NAME``) and the whole transition
message as JSON on stdin. It runs under a timeout (then it is killed). Hooks run one at a time,
in the order of the transitions, after the transition is safely in the outbox; a hook is run at
most once (an agent killed while a hook runs does not run it again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from schemas import (
    HookResultData,
    HookResultMessage,
    ReplyAddress,
    Transition,
    VmIdentity,
)

from ._observability import Metrics
from ._settings import HookSpec
from ._state import StateStore

__all__ = ["HookRunner", "hook_environment"]

log = logging.getLogger(__name__)

_TAIL = 2000


def hook_environment(transition: Transition, vm: str) -> dict[str, str]:
    event = transition.event
    wire = event.to_imds()
    return {
        "EVENT_ID": event.event_id,
        "EVENT_TYPE": event.event_type,
        "EVENT_STATUS": event.event_status,
        "NOT_BEFORE": str(wire.get("NotBefore", "")),
        "EVENT_RESOURCES": ",".join(event.resources),
        "EVENT_DESCRIPTION": event.description or "",
        "EVENT_SOURCE": event.event_source or "",
        "EVENT_DURATION": str(event.duration_in_seconds),
        "TRANSITION": transition.kind.value,
        "PREVIOUS_STATUS": transition.previous_status or "",
        "VM_NAME": vm,
    }


class HookRunner:
    """``submit`` queues the hooks a transition asks for; ``run`` runs them until cancelled."""

    def __init__(
        self,
        hooks: Sequence[HookSpec],
        *,
        timeout: float,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        store: StateStore,
        metrics: Metrics,
        committed: Callable[[], None],
    ) -> None:
        self._hooks = tuple(hooks)
        self._timeout = timeout
        self._identity = identity
        self._reply_to = reply_to
        self._store = store
        self._metrics = metrics
        self._committed = committed
        self._queue: asyncio.Queue[tuple[HookSpec, Transition, bytes]] = asyncio.Queue()

    def submit(self, transition: Transition, message_body: bytes) -> None:
        for hook in self._hooks:
            if transition.kind in hook.on:
                self._queue.put_nowait((hook, transition, message_body))

    async def run(self) -> None:
        while True:
            hook, transition, body = await self._queue.get()
            await self._run_one(hook, transition, body)

    async def _run_one(self, hook: HookSpec, transition: Transition, body: bytes) -> None:
        argv = shlex.split(hook.command)
        env = {**os.environ, **hook_environment(transition, self._identity.name)}
        started = time.monotonic()
        timed_out = False
        exit_code: int | None = None
        output = b""
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        except OSError as exc:
            log.error("hook %r could not start: %s", hook.command, exc)
            output = f"could not start: {exc}".encode()
        else:
            try:
                output, _ = await asyncio.wait_for(process.communicate(body), self._timeout)
                exit_code = process.returncode
            except TimeoutError:
                timed_out = True
                process.kill()
                try:
                    output, _ = await asyncio.wait_for(process.communicate(), 5)
                except TimeoutError:
                    log.error("hook %r did not die after kill", hook.command)
                exit_code = process.returncode
        duration = time.monotonic() - started
        result = "ok" if exit_code == 0 and not timed_out else "timeout" if timed_out else "failed"
        self._metrics.hooks.labels(result).inc()
        log.info(
            "hook %r on %s %s: %s (exit %s, %.2f s)",
            hook.command,
            transition.kind.value,
            transition.event.event_id,
            result,
            exit_code,
            duration,
        )
        data = HookResultData(
            vm=self._identity,
            event=transition.event,
            transition=transition.kind.value,
            hook=hook.command,
            exit_code=exit_code,
            timed_out=timed_out,
            duration_seconds=round(duration, 3),
            output_tail=output[-_TAIL:].decode("utf-8", "replace"),
            reply_to=self._reply_to,
        )
        message = HookResultMessage.build(data, observed_at=datetime.now(UTC))
        await self._store.commit([message])
        self._committed()
