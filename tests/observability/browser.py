"""Debian's chromium driven by Playwright's Python package: nothing downloaded (never `playwright install`).

`browser_or_skip()` says why a test cannot run: no /usr/bin/chromium (Debian: `apt-get install chromium`,
scripts/setup.sh does it as root) or no playwright package (`pip install -e '.[test]'`)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM = os.environ.get("LLMDEPLOY_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def missing() -> str | None:
    """Why no browser test can run here, or None."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) and not shutil.which(CHROMIUM):
        return f"chromium is not installed at {CHROMIUM} (Debian/Ubuntu: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A browser context; pages opened in it record console errors in page.errors (uncaught ones too)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height}, color_scheme="light")
            yield context
        finally:
            browser.close()


def open_page(context: Any, url: str) -> Any:
    page = context.new_page()
    page.errors = []
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: page.errors.append(f"uncaught: {exc}"))
    page.goto(url)
    return page
