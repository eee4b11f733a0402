"""Local hooks: a command run on chosen transitions, its result published as ``hook.completed``.

The command gets the event in environment variables (``EVENT_ID``, ``EVENT_TYPE``,
``EVENT_STATUS``, ``NOT_BEFORE``, ``EVENT_RESOURCES``, ``EVENT_DESCRIPTION``,
``EVENT_SOURCE``, ``EVENT_DURATION``, ``TRANSITION``, ``PREVIOUS_STATUS``, ``VM_NAME``,
``HOOK_ATTEMPT``) and the whole transition message as JSON on stdin. It runs under a timeout
(then it is killed). Hooks run one at a time, in the order of the transitions. A command that
cannot start, for whatever reason, is that run's result (``not-started``), never the agent's
end.

Hook runs are durable (:class:`~publisher._state.StateStore`): queued in the same transaction as
their transition, marked running before the command starts, removed when their result is in the
outbox. So an agent killed while a hook runs reports it on its next start — ``hook.completed``
with the outcome ``interrupted`` — or, with ``hook_rerun_interrupted`` (for hooks that are safe
to repeat), runs it again; a ``hooks_done`` policy never waits for a hook that will never report.

Given the hooks configured now, the runner executes a stored run's hook only if it is one of
them, never the command the run's row names: a hook is known by its command, and a run executes
when a hook with that command is configured for the run's transition (the kind of the
transition its body holds). A run of a hook removed, or whose command changed, before the run
started is reported (``not-started``, or ``interrupted`` for one a restart cut off) and not
executed; so is a row written into the state file by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from schemas import (
    HookOutcome,
    HookResultData,
    HookResultMessage,
    ReplyAddress,
    SchemaError,
    TransitionMessage,
    VmIdentity,
    decode,
)

from ._observability import Metrics
from ._settings import MAX_HOOK_COMMAND, HookSpec
from ._state import HookRun, StateStore

__all__ = ["HookRunner", "hook_environment"]

log = logging.getLogger(__name__)

_TAIL = 2000


def hook_environment(message: TransitionMessage, vm: str, attempt: int = 1) -> dict[str, str]:
    data = message.data
    event = data.event
    return {
        "EVENT_ID": event.event_id,
        "EVENT_TYPE": event.event_type,
        "EVENT_STATUS": event.event_status,
        "NOT_BEFORE": event.not_before_text,
        "EVENT_RESOURCES": ",".join(event.resources),
        "EVENT_DESCRIPTION": event.description or "",
        "EVENT_SOURCE": event.event_source or "",
        "EVENT_DURATION": str(event.duration_in_seconds),
        "TRANSITION": message.kind.value,
        "PREVIOUS_STATUS": data.previous_status or "",
        "VM_NAME": vm,
        "HOOK_ATTEMPT": str(attempt),
    }


def _text(text: str) -> str:
    """``text`` as a message may carry it: NUL, which the contract refuses (no database text
    type stores it), replaced by U+FFFD as undecodable bytes are. Before, a NUL in a hook's
    output made its result unpublishable (set aside, never seen)."""
    return text.replace("\0", "\ufffd")


async def _converse(process: asyncio.subprocess.Process, body: bytes, tail: bytearray) -> None:
    """Write ``body`` to the hook's stdin while reading its output into ``tail`` (its last
    :data:`_TAIL` bytes: a hook may write gigabytes, the agent holds no more than that), until
    the hook has ended and its output is closed."""
    feeder = asyncio.create_task(_feed(process, body))
    try:
        await _read_tail(process, tail)
        await process.wait()
        await feeder
    finally:
        feeder.cancel()  # cut off (the deadline, a stop): nothing more to write


async def _feed(process: asyncio.subprocess.Process, body: bytes) -> None:
    stdin = process.stdin
    assert stdin is not None
    try:
        stdin.write(body)
        await stdin.drain()
    except OSError:  # a hook that does not read all its stdin: its business, not a failure
        pass
    finally:
        stdin.close()


async def _read_tail(process: asyncio.subprocess.Process, tail: bytearray) -> None:
    """Read the hook's output to its end, a piece at a time, keeping the last bytes only."""
    stdout = process.stdout
    assert stdout is not None
    while chunk := await stdout.read(65536):
        if len(chunk) >= _TAIL:
            tail[:] = chunk[-_TAIL:]
        else:
            tail += chunk
            del tail[:-_TAIL]


def _stored_command(run: HookRun) -> str:
    """The command a run was queued with (its row holds ``KIND[,KIND...]=COMMAND``)."""
    return run.hook.partition("=")[2] or run.hook


class HookRunner:
    """Runs the hook runs the state store holds, oldest first; :meth:`notify` after a commit
    that queued some. :meth:`run` until cancelled.

    ``hooks``: the hooks configured now; a stored run executes only one of them."""

    def __init__(
        self,
        *,
        timeout: float,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        store: StateStore,
        metrics: Metrics,
        committed: Callable[[], None],
        rerun_interrupted: bool = False,
        hooks: Sequence[HookSpec],
    ) -> None:
        self._timeout = timeout
        self._identity = identity
        self._reply_to = reply_to
        self._store = store
        self._metrics = metrics
        self._committed = committed
        self._rerun = rerun_interrupted
        self._hooks = tuple(hooks)
        self._wake = asyncio.Event()
        self._first = True

    def notify(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            runs = await self._store.hook_runs()
            first, self._first = self._first, False
            for run in runs:
                if run.state not in ("queued", "running"):
                    continue
                cut_off = run.state == "running" and first
                message = self._transition(run)
                if message is None:
                    # Said to be dropped, so dropped now (a run cut off was left, and said so
                    # again at each start).
                    await self._store.commit([], hook_done=run.run_id)
                    continue
                command = self._configured(run, message)
                if command is None:
                    await self._not_configured(run, message, cut_off)
                elif cut_off:
                    await self._interrupted(run, message, command)
                else:
                    await self._run_one(run, message, command, run.attempt + 1)
            await self._wake.wait()

    def _configured(self, run: HookRun, message: TransitionMessage) -> str | None:
        """The command ``run`` may execute: that of a hook configured now with the command the
        run was queued with, on the run's transition. None: no such hook (removed, its command
        changed, or the row was not written by this agent), so nothing is executed for it.

        The command compared, not the whole ``KIND[,KIND...]=COMMAND`` text: a hook whose flag
        now names more transitions is the same hook, and its queued runs still run. The
        transition is the one the run's body holds (the contract checked it), not the row's
        text."""
        stored = _stored_command(run)
        kind = message.kind.value  # its MessageType is named as its TransitionKind
        for hook in self._hooks:
            if hook.command == stored and kind in hook.on:
                return hook.command
        return None

    async def _not_configured(
        self, run: HookRun, message: TransitionMessage, cut_off: bool
    ) -> None:
        """A stored run of a hook not configured now: reported, not executed. ``interrupted``
        for a run a restart cut off (it did start, its result is unknown), else
        ``not-started``: either way not succeeded, so a ``hooks_done`` policy does not count
        it as done."""
        outcome = HookOutcome.INTERRUPTED if cut_off else HookOutcome.NOT_STARTED
        # The row's text, bounded as a configured command is: it names the run in the log and
        # the report, it is never run. A crafted row may hold anything.
        command = _stored_command(run)[:MAX_HOOK_COMMAND]
        log.warning(
            "hook %r is no longer configured: run for transition %s (%s %s) not executed, "
            "reported as %s",
            command[:200],
            message.id,
            message.kind.value,
            message.data.event.event_id,
            outcome.value,
        )
        why = "not run: this hook is no longer configured on this agent"
        if cut_off:
            why = f"cut off by a restart, and {why}"
        await self._report(
            run, message, command, outcome, None, False, 0.0, why.encode(), run.attempt
        )

    async def _interrupted(self, run: HookRun, message: TransitionMessage, command: str) -> None:
        """A run that was cut off by the agent stopping (a crash, kill -9, power loss)."""
        if self._rerun:
            log.warning(
                "hook %r for transition %s was cut off by a restart: running it again "
                "(hook_rerun_interrupted)",
                command,
                message.id,
            )
            await self._run_one(run, message, command, run.attempt + 1)
            return
        log.warning(
            "hook %r for transition %s was cut off by a restart: reported as interrupted (set "
            "hook_rerun_interrupted for hooks that are safe to run again)",
            command,
            message.id,
        )
        await self._report(
            run, message, command, HookOutcome.INTERRUPTED, None, False, 0.0, b"", run.attempt
        )

    def _transition(self, run: HookRun) -> TransitionMessage | None:
        try:
            message = decode(run.body)
        except SchemaError as exc:  # only a downgrade could make it unreadable
            log.error("hook run %s: its transition cannot be read (%s): dropped", run.run_id, exc)
            return None
        if not isinstance(message, TransitionMessage):
            log.error("hook run %s is not about a transition: dropped", run.run_id)
            return None
        return message

    async def _run_one(
        self, run: HookRun, message: TransitionMessage, command: str, attempt: int
    ) -> None:
        await self._store.hook_started(run.run_id, attempt)
        started = time.monotonic()
        timed_out = False
        exit_code: int | None = None
        tail = bytearray()
        outcome = HookOutcome.FAILED
        try:
            process = await self._start(command, message, attempt)
        except Exception as exc:
            # A command that cannot be split (an unbalanced quote), names no program, holds a
            # NUL, or that the OS refuses: this run's result, never the runner's end (the run
            # is stored: it ended the agent, and every restart after, before).
            log.error("hook %r could not start (%s): reported as not started", command, exc)
            tail += f"could not start: {exc}".encode()
            outcome = HookOutcome.NOT_STARTED
        else:
            try:
                # asyncio.timeout, not wait_for (which may drop a stop's cancel on Python 3.11)
                async with asyncio.timeout(self._timeout):
                    await _converse(process, run.body, tail)
                exit_code = process.returncode
                outcome = HookOutcome.OK if exit_code == 0 else HookOutcome.FAILED
            except TimeoutError:
                timed_out = True
                outcome = HookOutcome.TIMED_OUT
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    process.kill()
                try:
                    async with asyncio.timeout(5):
                        await _read_tail(process, tail)
                        await process.wait()
                except TimeoutError:
                    log.error(
                        "hook %r did not die, or something it started holds its output, 5 s "
                        "after it was killed: reported as timed out",
                        command,
                    )
                exit_code = process.returncode
        output = bytes(tail)
        duration = time.monotonic() - started
        log.info(
            "hook %r on %s %s: %s (exit %s, %.2f s, attempt %d)",
            command,
            message.kind.value,
            message.data.event.event_id,
            outcome.value,
            exit_code,
            duration,
            attempt,
        )
        await self._report(
            run, message, command, outcome, exit_code, timed_out, duration, output, attempt
        )

    async def _start(
        self, command: str, message: TransitionMessage, attempt: int
    ) -> asyncio.subprocess.Process:
        """The hook's process (without a shell: the command split as a shell would)."""
        argv = shlex.split(command)  # ValueError: an unbalanced quote
        if not argv:
            raise ValueError("the command names no program to run")
        env = {**os.environ, **hook_environment(message, self._identity.name, attempt)}
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )

    async def _report(
        self,
        run: HookRun,
        message: TransitionMessage,
        command: str,
        outcome: HookOutcome,
        exit_code: int | None,
        timed_out: bool,
        duration: float,
        output: bytes,
        attempt: int,
    ) -> None:
        self._metrics.hooks.labels(outcome.value).inc()
        try:
            data = HookResultData(
                vm=self._identity,
                event=message.data.event,
                transition=message.kind.value,
                hook=_text(command),
                exit_code=exit_code,
                timed_out=timed_out,
                duration_seconds=round(duration, 3),
                output_tail=_text(output[-_TAIL:].decode("utf-8", "replace")),
                reply_to=self._reply_to,
                outcome=outcome.value,
                # The transition's own id (from the body the contract checked), not the run
                # row's copy of it: an edited cell went into the result (one with a NUL made
                # it unpublishable).
                transition_id=message.id,
                attempt=max(attempt, 1),
            )
            result = HookResultMessage.build(data, observed_at=datetime.now(UTC))
        except Exception:
            # A result the contract refuses is a defect of this code, met by this run alone:
            # raised, it ended the runner (and the agent), and the stored run did the same at
            # every start, so no later hook ever reported. It costs this run's report only.
            log.exception(
                "the result of hook %r for %s %s (outcome %s) cannot be built: not reported, "
                "and the run is marked done so it is not run again (a policy waiting for it "
                "leaves the event to NotBefore); the other runs go on",
                command,
                message.kind.value,
                message.data.event.event_id,
                outcome.value,
            )
            await self._store.commit([], hook_done=run.run_id)
            return
        await self._store.commit([result], hook_done=run.run_id)
        self._committed()
