"""The IMDS client: Scheduled Events (GET, POST StartRequests) and the instance identity.

Over :mod:`publisher._http` (never through a proxy, no redirect followed), always the
``Metadata: true`` header, every request through the shared
:class:`~publisher._poller.RequestLimiter`. An error is an error: a 5xx, a 429, a timeout or a
body that is not a document raises :class:`~schemas.ImdsError` (``kind`` says which), never an
empty event list. A document one of whose events cannot be read is a document: that event is in
its ``unreadable`` list, and the watcher decides what it means (it is never taken for gone).

IMDS cannot stall or swell the agent: every request has an overall ``deadline`` (connect, send,
every byte of the answer: a server dripping one byte every two seconds fails at the deadline,
not after the sum of per-read timeouts), and an answer larger than ``max_body`` bytes is refused
as it arrives (a document with thousands of events is well under the default 1 MiB). A POST
answered with any 2xx was taken, whatever body comes with it (too large, malformed): the agent
reads none of it.

>>> async with ImdsClient("http://169.254.169.254") as imds:     # doctest: +SKIP
...     document = await imds.scheduled_events()
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import urlencode, urlsplit

from schemas import (
    DEFAULT_API_VERSION,
    ImdsError,
    ImdsThrottled,
    ScheduledEventsDocument,
    SchemaError,
    VmIdentity,
)
from schemas._backoff import Backoff
from schemas.messages import loads, parse_json

from ._http import (
    BodyTooLarge,
    ConnectFailed,
    HttpClient,
    HttpError,
    KeptConnectionDropped,
    Response,
)
from ._poller import RequestLimiter, RequestSlot

__all__ = ["RETRYABLE_KINDS", "ImdsClient", "with_retries"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Error kinds worth asking again (the others are our fault, or a 4xx that will not change).
RETRYABLE_KINDS = frozenset(
    {"throttled", "gone", "server", "timeout", "connection", "garbage", "too-large"}
)
#: A POST goes on a kept connection only if it was idle at most this long (seconds), else on a
#: new one. IMDS (any server) closes a connection left idle past its keep-alive, which Azure
#: does not document (uvicorn's is 5 s, common servers' 5 s to minutes); a POST sent as it
#: does may have been read and cannot be sent again. Within a second of the last answer that
#: cannot happen short of a server far quicker to let go than any; and an approval's POST
#: mostly follows the poll it was checked on by less. A new connection costs an agent whose
#: loop runs late several turns of it: in a traced 2,000-VM fleet run on one machine a POST
#: took 2.3 and 1.4 s (p50, two agent processes), about 1.5 and 0.8 s of it connecting.
POST_KEPT_IDLE = 1.0
#: The largest answer taken from IMDS.
DEFAULT_MAX_BODY = 1024 * 1024


@functools.cache
def _version_query(api_version: str) -> str:
    """``api-version=...``, made once per version (every poll asks for it)."""
    return urlencode({"api-version": api_version})


def _kind_of_status(status: int) -> str:
    if status == 429:
        return "throttled"
    if status == 410:
        return "gone"
    if status >= 500:
        return "server"
    return "client"


class ImdsClient:
    """One VM's IMDS. ``base_url`` is what ``/metadata/...`` is appended to."""

    def __init__(
        self,
        base_url: str,
        *,
        api_version: str = DEFAULT_API_VERSION,
        instance_api_version: str = "2021-02-01",
        timeout: float = 5.0,
        first_timeout: float = 120.0,
        max_body: int = DEFAULT_MAX_BODY,
        limiter: RequestLimiter | None = None,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_version = api_version
        self.instance_api_version = instance_api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.max_body = max_body
        self.limiter = limiter or RequestLimiter()
        self._on_request = on_request
        self._events_url = f"{self.base_url}/metadata/scheduledevents"
        self._instance_url = f"{self.base_url}/metadata/instance"
        self._attested_url = f"{self.base_url}/metadata/attested/document"
        self._answered = False
        self._last: tuple[bytes, ScheduledEventsDocument] | None = None
        # Never through a proxy, never a redirect followed: the client knows neither.
        self._client = HttpClient(self.base_url, headers={"Metadata": "true"})
        self._prefix = urlsplit(self.base_url).path

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(
        self,
        method: str,
        url: str,
        api_version: str,
        *,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
    ) -> bytes:
        """One request under one overall deadline; the answer's body (at most ``max_body``)."""
        endpoint = url.removeprefix(self.base_url + "/metadata/")
        what = f"IMDS {method} {url}"
        path = self._prefix + url.removeprefix(self.base_url)
        query = (
            urlencode({"api-version": api_version, **params})
            if params
            else _version_query(api_version)
        )
        target = f"{path}?{query}"
        # Nothing may fail between the admission and the send: past _admit, only _send gives
        # the slot back (or writes the request).
        slot = await self._admit(endpoint)
        # The first Scheduled Events call enables the service and may take two minutes.
        deadline = self.timeout if self._answered else self.first_timeout
        try:
            async with asyncio.timeout(deadline):
                try:
                    # A POST on a kept connection only if it was used a moment ago: on one
                    # idle longer, IMDS may be letting it go just then, and a POST that meets
                    # that may have been taken.
                    response = await self._send(
                        slot,
                        method,
                        target,
                        body,
                        max_idle=POST_KEPT_IDLE if method == "POST" else None,
                    )
                except KeptConnectionDropped as exc:
                    if method != "GET":
                        raise  # IMDS may have read it: a POST is never sent twice
                    # IMDS most likely let the connection go while it was idle (this loop
                    # stalled past its keep-alive): asked again now on a new connection, as
                    # a request of its own for the VM's budget.
                    log.debug("%s: %s; asked again on a new connection", what, exc)
                    slot = await self._admit(endpoint)
                    response = await self._send(slot, method, target, body, max_idle=0.0)
        except TimeoutError as exc:
            # The deadline may also pass while connecting, before anything went out: counted as
            # unanswered all the same, the side that never calls a started event canceled.
            raise ImdsError(
                f"{what} took more than {deadline:g} s", kind="timeout", unanswered=True
            ) from exc
        except HttpError as exc:
            if method == "POST" and exc.status is not None and 200 <= exc.status < 300:
                # IMDS took the POST: its status says so. The body that came with it (never
                # read: too large, malformed, cut off) changes nothing; before, a 200 with a
                # large body was a failure, POSTed again and reported refused.
                log.warning("%s answered %d; its body is not read (%s)", what, exc.status, exc)
                return b""
            if isinstance(exc, BodyTooLarge):
                raise ImdsError(
                    f"{what} {exc}: refused", status=exc.status, kind="too-large"
                ) from exc
            raise ImdsError(
                f"{what} failed: {exc}",
                kind="connection",
                unanswered=not isinstance(exc, ConnectFailed),
            ) from exc
        status, content = response.status, response.body
        if status == 429:
            self.limiter.throttled()
        if method == "POST" and 200 <= status < 300:
            return content  # taken (any 2xx: its body is nothing the agent reads)
        if status != 200:
            kind = _kind_of_status(status)
            error = ImdsThrottled if kind == "throttled" else ImdsError
            hint = ""
            if status == 404:
                hint = (
                    f" (check --imds-url {self.base_url!r}: the agent asks it for "
                    "/metadata/scheduledevents and /metadata/instance)"
                )
            raise error(
                f"{what} answered {status}: {content[:200]!r}{hint}", status=status, kind=kind
            )
        return content

    async def _admit(self, endpoint: str) -> RequestSlot:
        """Every request IMDS may receive waits for the VM's budget and is counted. Its slot
        holds a place in the budget until :meth:`_send` gives it back or writes the request."""
        slot = await self.limiter.acquire()
        if self._on_request is not None:
            try:
                self._on_request(endpoint)
            except BaseException:
                slot.release()  # never sent: a place held for ever would shrink the budget
                raise
        return slot

    async def _send(
        self,
        slot: RequestSlot,
        method: str,
        target: str,
        body: bytes | None,
        *,
        max_idle: float | None,
    ) -> Response:
        """Send it on ``slot``, which counts from the moment it is written (a new connection
        may take a while to open before that); never written, its place goes back."""
        try:
            return await self._client.request(
                method,
                target,
                body=body,
                headers={"Content-Type": "application/json"} if body is not None else None,
                max_body=self.max_body,
                max_idle=max_idle,
                sending=slot.went_out,
            )
        finally:
            slot.release()

    async def scheduled_events(self) -> ScheduledEventsDocument:
        """One GET of the document (no retry: the poller decides when to ask again; only a GET
        sent on a kept connection IMDS let go is asked again at once, see :meth:`_request`)."""
        raw = await self._request("GET", self._events_url, self.api_version)
        if self._last is not None and self._last[0] == raw:
            self._answered = True
            return self._last[1]  # the same bytes: no need to parse them again
        try:
            data = _document_json(raw)
            # A document without its Events list is garbage, not "no events": only IMDS saying
            # "Events": [] may empty the list. An item of the list that is not a valid event is
            # not: the document keeps it as unreadable (one neighbour's broken event must not
            # hide this VM's own).
            if not isinstance(data, dict) or not isinstance(data.get("Events"), list):
                raise SchemaError("the answer has no Events list")
            document = ScheduledEventsDocument.from_imds(data)
        except (SchemaError, RecursionError) as exc:
            raise ImdsError(f"IMDS answered garbage: {exc}", status=200, kind="garbage") from exc
        self._answered = True
        self._last = (raw, document)
        return document

    async def start_events(self, event_ids: Iterable[str]) -> None:
        """POST ``StartRequests`` for these events (no retry)."""
        body = json.dumps({"StartRequests": [{"EventId": e} for e in event_ids]}).encode()
        await self._request("POST", self._events_url, self.api_version, body=body)

    async def attested(self, nonce: str) -> str:
        """The attested document (``signature``: base64 PKCS#7) Azure signs for this VM with
        ``nonce`` in it (no retry)."""
        raw = await self._request("GET", self._attested_url, "2020-09-01", params={"nonce": nonce})
        try:
            data = loads(raw)
        except (SchemaError, RecursionError) as exc:
            raise ImdsError(f"IMDS attested data is not JSON: {exc}", kind="garbage") from exc
        signature = data.get("signature") if isinstance(data, dict) else None
        if not isinstance(signature, str) or not signature:
            raise ImdsError("IMDS attested data has no signature", status=200, kind="garbage")
        return signature

    async def identity(self) -> VmIdentity:
        """Who this VM is, from ``/metadata/instance`` (no retry)."""
        raw = await self._request("GET", self._instance_url, self.instance_api_version)
        try:
            return VmIdentity.from_instance_metadata(loads(raw))
        except (SchemaError, RecursionError) as exc:
            raise ImdsError(
                f"IMDS instance metadata is not usable: {exc}", status=200, kind="garbage"
            ) from exc


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff,
    attempts: int | None = None,
    on_error: Callable[[ImdsError], None] | None = None,
) -> T:
    """``call()`` until it succeeds, retrying retryable :class:`ImdsError` after a jittered,
    capped delay; ``attempts`` None retries until cancelled (start-up needs the identity)."""
    tried = 0
    while True:
        try:
            result = await call()
        except ImdsError as exc:
            tried += 1
            if on_error is not None:
                on_error(exc)
            if exc.kind not in RETRYABLE_KINDS or (attempts is not None and tried >= attempts):
                raise
            delay = backoff.next()
            log.warning("%s failed (%s); retrying in %.2f s", what, exc, delay)
            await asyncio.sleep(delay)
            continue
        backoff.reset()
        return result


def _document_json(raw: bytes) -> object:
    """The Scheduled Events document as JSON. Not the message contract's :func:`loads`: its
    256 KiB cap is a message's, and a placement group's document lists every neighbour's event
    (the answer is bounded by ``--imds-max-body`` as it is read); and it refuses U+0000, which
    in one event's text would hide every event of the document. A NUL is carried as U+FFFD
    instead (no consumer could store it). NaN and Infinity, bad UTF-8, lone surrogates and
    nesting too deep are garbage, as for a message."""
    data = parse_json(raw)
    return _without_nul(data) if b"\\u0000" in raw else data


def _without_nul(value: object) -> object:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    return value
