"""A Service Bus receiver that keeps failing is said once, then when it is back: before, each
failed try was a WARNING (growing pauses, at most 15 s apart: four lines a minute from every VM
listening for approvals while its namespace is unreachable, tens of thousands a minute from a
fleet). The real SDK against the double, through a TCP proxy that cuts the link."""

from __future__ import annotations

import asyncio
import logging

import pytest

from schemas import ChannelNames
from schemas.transport.servicebus import ServiceBusTransport
from tests.servicebus.conftest import an_approval_arrives, close_what_the_sdk_left_open
from tests.servicebus_double import ServiceBusDouble
from tests.transport.proxy import TcpProxy

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(60)]


def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "schemas.transport.servicebus" and r.levelno == level
    ]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_receiver_failing_for_seconds_is_said_once_then_when_it_is_back(
    double: ServiceBusDouble, channels: ChannelNames, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="schemas.transport.servicebus")
    async with TcpProxy(double.host, double.port) as proxy:
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=2;send_timeout=2"
        )
        async with ServiceBusTransport(address, channels) as transport:
            subscription = transport.approvals("vm-a")
            try:
                waiting = asyncio.ensure_future(anext(subscription))
                await asyncio.sleep(1.5)  # its receiver is open and waiting
                caplog.clear()
                await proxy.cut()
                await asyncio.sleep(8)
                tries = len(_said(caplog, logging.DEBUG)) + len(_said(caplog, logging.WARNING))
                await proxy.restore()
                await an_approval_arrives(transport, waiting, within=30)
            finally:
                await subscription.close()
    close_what_the_sdk_left_open()
    warnings = _said(caplog, logging.WARNING)
    assert tries >= 3, tries  # it did keep trying
    assert len(warnings) == 1, warnings
    assert "said again when it is back" in warnings[0]
    back = [line for line in _said(caplog, logging.INFO) if "works again" in line]
    assert len(back) == 1, _said(caplog, logging.INFO)
