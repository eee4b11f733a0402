"""Fixtures of the console tests: Debian's Chromium driven by Playwright.

Playwright comes from PyPI and drives the system's ``/usr/bin/chromium`` (its own browser
download is never used). Without Chromium or Playwright the browser tests are skipped with the
reason; when ``CI`` is set they fail instead, saying what to install.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import pytest_asyncio

CHROMIUM = os.environ.get("RELAY_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Where the README's screenshots live; the tests write there only with RELAY_SCREENSHOTS=1
#: (else to a temporary directory), so a test run leaves the work tree as it was.
SCREENSHOTS = Path(__file__).parent / "screenshots"


def _missing(what: str, how: str) -> None:
    message = f"{what} is not available: {how}"
    if os.environ.get("CI"):
        pytest.fail(f"CI needs {what}. {message}", pytrace=False)
    pytest.skip(message)


def _chromium_present() -> bool:
    return Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is not None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser():
    """A headless Chromium for the module's tests (each test opens contexts of its own: no
    cookie or storage carries over). The tests that use it run in the module's event loop."""
    if not _chromium_present():
        _missing("Chromium", f"no {CHROMIUM}: apt-get install -y chromium")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _missing("Playwright", "pip install playwright (never `playwright install`)")
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def screenshots(tmp_path) -> Path:
    """The directory screenshots go to (see :data:`SCREENSHOTS`)."""
    if os.environ.get("RELAY_SCREENSHOTS"):
        SCREENSHOTS.mkdir(exist_ok=True)
        return SCREENSHOTS
    return tmp_path
