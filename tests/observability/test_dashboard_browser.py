"""/dashboard in a real headless browser (Debian's chromium through Playwright) against a real deployment: log in
with an API key, no console errors, the revision and split on the page, then `llmdeploy canary --percent 20`
and the page follows."""

from __future__ import annotations

import pytest

from tests.observability import browser
from tests.observability.conftest import CLIENT_KEY, ensure_candidate, traffic

if browser.missing() is None:
    from playwright.sync_api import expect

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=browser.missing() or "")
TIMEOUT_MS = 30_000  # the page polls every second; the machine may be busy


def login(page) -> None:
    page.wait_for_selector("#login-form", state="visible", timeout=TIMEOUT_MS)
    assert page.is_hidden("#board")
    page.fill("#key", CLIENT_KEY)
    page.click("#login-button")
    page.wait_for_selector("#board", state="visible", timeout=TIMEOUT_MS)


def test_dashboard_follows_a_canary(obs):
    candidate = ensure_candidate(obs)
    traffic(obs)
    with browser.chromium() as context:
        page = browser.open_page(context, f"{obs['url']}/dashboard")
        login(page)
        # locator assertions, not wait_for_function: the page's CSP (no eval) stays in force under test
        expect(page.locator("#current-revision")).to_have_text("1", timeout=TIMEOUT_MS)
        split = page.text_content("#split-text")
        assert "rev 1 (stable) 100%" in split and f"rev {candidate} (candidate) 0%" in split, split
        # the key lives in this tab only, never in a cookie or localStorage
        assert page.evaluate("sessionStorage.getItem('llmdeploy.dashboard.key')") == CLIENT_KEY
        assert page.evaluate("document.cookie + JSON.stringify(localStorage)") == "{}"

        obs["cli"].ok("canary", "--percent", "20")
        expect(page.locator("#split-text")).to_contain_text("(candidate) 20%", timeout=TIMEOUT_MS)
        assert "rev 1 (stable) 80%" in page.text_content("#split-text")
        row = page.locator(f'#revisions tr[data-revision="{candidate}"]')
        assert row.get_attribute("data-percent") == "20"
        page.wait_for_selector('#events tr[data-kind="canary"]', timeout=TIMEOUT_MS)
        # the other panels drew from the same document: both backends served, replicas with memory, cost
        assert page.locator("#replicas tbody tr").count() == 2
        assert "RSS" in page.text_content("#replicas")
        assert "USD" in page.text_content("#cost")
        assert page.locator("#chart-tokens path.series").count() == 2
        assert page.errors == [], page.errors
        obs["cli"].ok("canary", "--percent", "0")


def test_a_wrong_key_is_refused_and_the_form_says_so(obs):
    with browser.chromium() as context:
        page = browser.open_page(context, f"{obs['url']}/dashboard")
        page.wait_for_selector("#login-form", state="visible", timeout=TIMEOUT_MS)
        page.fill("#key", "sk-not-a-key")
        page.click("#login-button")
        expect(page.locator("#login-error")).to_contain_text("not accepted", timeout=TIMEOUT_MS)
        assert page.is_hidden("#board")
        assert page.evaluate("sessionStorage.getItem('llmdeploy.dashboard.key')") is None
