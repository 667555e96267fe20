"""Take the README's screenshots: /dashboard and `llmdeploy status --watch` of a real demo deployment.

    .venv/bin/python scripts/screenshots.py            # writes docs/images/dashboard.png, status-watch.png

It starts a throwaway deployment in a temporary LLMDEPLOY_HOME (the tests' tiny random Llama, the tests' fake
cloud for the spill, a cost: section), applies a second revision, sends traffic with a 20% canary, saves a bench
run, then photographs the page with Debian's chromium (Playwright, no browser download) and renders the status
view with rich's SVG export, which chromium turns into a PNG. Everything it started is stopped at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402

from llmdeploy.cli.deploy_views import status_view  # noqa: E402
from llmdeploy.cli.observe_views import watch_frame  # noqa: E402
from tests.control.conftest import Cli, base_spec, write_spec  # noqa: E402
from tests.helpers.fake_cloud import FakeCloud  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model  # noqa: E402
from tests.observability import browser  # noqa: E402

OUT = REPO / "docs" / "images"
NAME = "chat"
KEY = "sk-demo-dashboard"


async def _traffic(url: str, n: int, rounds: int, pause_s: float) -> None:
    import httpx

    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
        for r in range(rounds):
            bodies = [
                {"model": "tiny", "prompt": f"hello {r} {i}", "max_tokens": 8, "stream": True}
                for i in range(n)
            ]
            await asyncio.gather(
                *(
                    client.post("/v1/completions", json=b, headers={"x-session-id": f"u{r}-{i}"})
                    for i, b in enumerate(bodies)
                )
            )
            await asyncio.sleep(pause_s)


def status_png(cli: Cli, page) -> None:
    st = json.loads(cli.ok("status", "--name", NAME, "--json").stdout)
    console = Console(record=True, width=150, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(watch_frame(status_view(st)))
    page.set_content(
        f"<html><body style='margin:0'>{console.export_svg(title='llmdeploy status --watch')}</body></html>"
    )
    page.locator("svg").first.screenshot(path=str(OUT / "status-watch.png"))


def main() -> int:
    if why := browser.missing():
        print(f"cannot take screenshots: {why}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", "llama")
        cloud = FakeCloud(root, expected_key="cloud-demo").start()
        cli = Cli(root / "home", env={"DEMO_KEY": KEY, "DEMO_CLOUD_KEY": "cloud-demo"})
        spec = base_spec(
            NAME,
            model,
            auth={"api_key_required": True, "keys": [{"name": "app", "key_env": "DEMO_KEY"}]},
            cloud={
                "enabled": True,
                "provider": "openai-compatible",
                "base_url": f"{cloud.base}/v1",
                "api_key_env": "DEMO_CLOUD_KEY",
                "model": "ernie-demo",
            },
            routing={"burst": {"local_rps": 4}, "overflow": {"use_predicted_ttft": False}},
            sla={"ttft_p99_ms": 5000, "tpot_p99_ms": 5000},
            cost={"cloud_input_per_1m": 0.55, "cloud_output_per_1m": 2.2, "local_per_hour": 1.1},
        )
        url = f"http://{spec['listen']}"
        try:
            cli.ok("apply", str(write_spec(root / "v1.yaml", spec)))
            asyncio.run(_traffic(url, 6, 8, 1.0))
            v2 = {**spec, "engine": {**spec["engine"], "max_num_seqs": 8}}
            cli.ok("apply", str(write_spec(root / "v2.yaml", v2)))
            cli.ok("canary", "--percent", "20")
            v1 = root / "v1.yaml"
            cli.ok(
                "bench",
                "--sla-from",
                str(v1),
                "--concurrency",
                "1,2,4",
                "--requests",
                "8",
                "--output-len",
                "8",
                "--save",
                timeout=600,
            )
            asyncio.run(_traffic(url, 8, 20, 1.0))
            with browser.chromium(width=1500, height=900) as context:
                page = browser.open_page(context, f"{url}/dashboard")
                page.fill("#key", KEY)
                page.click("#login-button")
                page.wait_for_selector("#board", state="visible")
                time.sleep(8)  # a few polls: the replica charts get some history
                page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)
                assert page.errors == [], page.errors
                status_png(cli, context.new_page())
        finally:
            cli.cleanup(NAME)
            cloud.stop()
    print(f"wrote {OUT / 'dashboard.png'} and {OUT / 'status-watch.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
