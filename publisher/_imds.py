"""The IMDS client: Scheduled Events (GET, POST StartRequests) and the instance identity.

Never through a proxy (``trust_env=False``), always the ``Metadata: true`` header, every request
through the shared :class:`~publisher._poller.RequestLimiter`. An error is an error: a 5xx, a
429, a timeout or a body that is not a document raises :class:`~schemas.ImdsError` (``kind``
says which), never an empty event list.

>>> async with ImdsClient("http://169.254.169.254") as imds:     # doctest: +SKIP
...     document = await imds.scheduled_events()
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Self, TypeVar

import httpx

from schemas import (
    DEFAULT_API_VERSION,
    ImdsError,
    ImdsThrottled,
    ScheduledEventsDocument,
    SchemaError,
    VmIdentity,
)

from ._backoff import Backoff
from ._poller import RequestLimiter

__all__ = ["RETRYABLE_KINDS", "ImdsClient", "with_retries"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Error kinds worth asking again (the others are our fault, or a 4xx that will not change).
RETRYABLE_KINDS = frozenset({"throttled", "gone", "server", "timeout", "connection", "garbage"})


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
        limiter: RequestLimiter | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_version = api_version
        self.instance_api_version = instance_api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.limiter = limiter or RequestLimiter()
        self._events_url = f"{self.base_url}/metadata/scheduledevents"
        self._instance_url = f"{self.base_url}/metadata/instance"
        self._answered = False
        self._last: tuple[bytes, ScheduledEventsDocument] | None = None
        self._client = httpx.AsyncClient(
            trust_env=False,
            headers={"Metadata": "true"},
            timeout=httpx.Timeout(timeout),
            follow_redirects=False,
            # IMDS is plain HTTP on a link-local address: an http:// base never uses TLS, so
            # the CA bundle (about 1.3 MiB resident) is not loaded for it.
            verify=not self.base_url.startswith("http://"),
        )

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
        self, method: str, url: str, api_version: str, *, body: bytes | None = None
    ) -> httpx.Response:
        await self.limiter.acquire()
        # The first Scheduled Events call enables the service and may take two minutes.
        timeout = self.timeout if self._answered else self.first_timeout
        try:
            response = await self._client.request(
                method,
                url,
                params={"api-version": api_version},
                content=body,
                headers={"Content-Type": "application/json"} if body is not None else None,
                timeout=timeout,
            )
        except httpx.TimeoutException as exc:
            raise ImdsError(f"IMDS {method} timed out after {timeout} s", kind="timeout") from exc
        except httpx.HTTPError as exc:
            raise ImdsError(f"IMDS {method} failed: {exc!r}", kind="connection") from exc
        if response.status_code != 200:
            kind = _kind_of_status(response.status_code)
            error = ImdsThrottled if kind == "throttled" else ImdsError
            raise error(
                f"IMDS {method} answered {response.status_code}: {response.text[:200]!r}",
                status=response.status_code,
                kind=kind,
            )
        return response

    async def scheduled_events(self) -> ScheduledEventsDocument:
        """One GET of the document (no retry: the poller decides when to ask again)."""
        response = await self._request("GET", self._events_url, self.api_version)
        raw = response.content
        if self._last is not None and self._last[0] == raw:
            self._answered = True
            return self._last[1]  # the same bytes: no need to parse them again
        try:
            data = json.loads(raw)
            # A document without its Events list is garbage, not "no events": only IMDS saying
            # "Events": [] may empty the list.
            if not isinstance(data, dict) or not isinstance(data.get("Events"), list):
                raise SchemaError("the answer has no Events list")
            document = ScheduledEventsDocument.from_imds(data)
        except (ValueError, SchemaError) as exc:
            raise ImdsError(f"IMDS answered garbage: {exc}", status=200, kind="garbage") from exc
        self._answered = True
        self._last = (raw, document)
        return document

    async def start_events(self, event_ids: Iterable[str]) -> None:
        """POST ``StartRequests`` for these events (no retry)."""
        body = json.dumps({"StartRequests": [{"EventId": e} for e in event_ids]}).encode()
        await self._request("POST", self._events_url, self.api_version, body=body)

    async def identity(self) -> VmIdentity:
        """Who this VM is, from ``/metadata/instance`` (no retry)."""
        response = await self._request("GET", self._instance_url, self.instance_api_version)
        try:
            return VmIdentity.from_instance_metadata(response.json())
        except (ValueError, SchemaError) as exc:
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
