"""`llmdeploy bench` against the real fake cloud (a server that is not llmdeploy's), and its invalid input,
through typer's runner and the installed script. No model runs here, so these stay fast."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmdeploy.cli.main import app
from tests.helpers.procs import free_port
from tests.loadgen.conftest import CLOUD_KEY, ENV

SCRIPT = Path(sys.executable).parent / "llmdeploy"


def bench(*args: str | Path):
    result = CliRunner().invoke(app, ["bench", *map(str, args)], env=ENV)
    assert CLOUD_KEY not in result.output
    return result


@pytest.fixture
def cloud(bench_cloud):
    bench_cloud.reset()
    yield bench_cloud
    bench_cloud.reset()


def target(cloud) -> list[str]:
    return ["--url", f"{cloud.base}/v1", "--model", "any", "--api-key-env", "CLOUD_KEY", "--warmup", "0"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.external += [v for k, v in attrs if k in ("src", "href") and v and v.startswith(("http", "//"))]


def test_a_server_that_is_not_llmdeploy(cloud, tmp_path):
    """No x-llmdeploy-backend header: "unknown"; no /metrics: reported absent (404), not a failure."""
    out, page = tmp_path / "run.json", tmp_path / "run.html"
    r = bench(
        *target(cloud),
        "--concurrency",
        "1,3",
        "-n",
        "6",
        "--ttft-p99-ms",
        "5000",
        "--json",
        out,
        "--chart",
        page,
    )
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert CLOUD_KEY not in out.read_text() and d["target"]["api_key_env"] == "CLOUD_KEY"
    for lv in d["levels"]:
        assert lv["ok"] == 6 and lv["backends"] == {"unknown": 6} and lv["server"] is None
        assert lv["output_tokens"] == 6 * 5 and lv["token_source"] == {
            "usage": 6
        }  # "Hello from the fake cloud"
        assert lv["ttft_ms"]["count"] == 6 and lv["tpot_ms"]["count"] == 6
    assert d["metrics"]["absent"] == {f"{cloud.base}/metrics": "HTTP 404"}
    parser = _Tags()
    parser.feed(page.read_text())
    assert {"html", "svg", "table"} <= parser.tags and "script" not in parser.tags and parser.external == []
    assert "SLA TTFT p99 5000 ms" in page.read_text()
    sent = cloud.requests()[-1]["body"]
    assert (
        sent["stream"] is True
        and sent["stream_options"] == {"include_usage": True}
        and sent["max_tokens"] == 128
    )


def test_tight_sla_exits_1(cloud, tmp_path):
    cloud.control(chunk_delay_s=0.05)  # TTFT >= 50 ms
    out = tmp_path / "tight.json"
    r = bench(*target(cloud), "-c", "1,2", "-n", "2", "--ttft-p99-ms", "20", "--json", out)
    assert r.exit_code == 1, r.output
    d = json.loads(out.read_text())
    assert (
        d["exit_code"] == 1
        and not d["verdict"]["asked_meets_sla"]
        and d["verdict"]["highest_passing"] is None
    )
    assert all(lv["sla_misses"][0].startswith("TTFT p99") for lv in d["levels"])
    r = bench(*target(cloud), "-c", "1,2", "-n", "2", "--ttft-p99-ms", "20000")
    assert r.exit_code == 0, r.output


def test_no_stream_and_a_dataset(cloud, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}\n'
    )
    out = tmp_path / "plain.json"
    r = bench(
        *target(cloud),
        "-c",
        "2",
        "-n",
        "4",
        "--dataset",
        data,
        "--no-stream",
        "--ttft-p99-ms",
        "1000",
        "--json",
        out,
    )
    assert r.exit_code == 0, r.output
    assert "no first token" in r.output
    d = json.loads(out.read_text())
    lv = d["levels"][0]
    assert (
        lv["ok"] == 4
        and lv["ttft_ms"]["p99"] is None
        and lv["tpot_ms"]["count"] == 0
        and lv["e2e_ms"]["count"] == 4
    )
    assert lv["output_tokens"] == 5 + 2 + 5 + 2  # usage of non-stream answers
    assert d["load"]["prompts"]["kind"] == "dataset" and d["load"]["stream"] is False
    bodies = [q["body"] for q in cloud.requests()[-4:]]
    assert {b["messages"][0]["content"] for b in bodies} == {"Hello", "Hi"}
    assert sorted(b.get("max_tokens") for b in bodies) == [2, 2, 128, 128]
    assert not any(b["stream"] for b in bodies)


def test_open_loop_burst_on_a_server_without_backends(cloud, tmp_path):
    """Rate levels, then a 3x burst from the highest one that met the SLA; outcomes are "unknown" on time/late."""
    out = tmp_path / "burst.json"
    r = bench(
        *target(cloud),
        "--rate",
        "2,4",
        "-n",
        "4",
        "--ttft-p99-ms",
        "5000",
        "--burst",
        "3x:1s:1s",
        "--json",
        out,
    )
    assert r.exit_code == 0, r.output
    b = json.loads(out.read_text())["burst"]
    assert (b["base_rate"], b["burst_rate"]) == (4.0, 12.0) and "(4/s)" in b["base_rate_reason"]
    for phase, outcomes in b["outcomes"].items():
        assert outcomes["unknown_on_time"] + outcomes["unknown_late"] == b["arrivals"][phase]
    assert b["arrivals"]["burst"] >= 1 and b["recovered"]


@pytest.mark.parametrize(
    ("control", "kind"),
    [({"error_after": 1}, "stream_error:internal_error"), ({"cut_after": 1}, "connection")],
)
def test_error_kinds_of_broken_streams(cloud, tmp_path, control, kind):
    """The one-token preflight passes; every longer answer then breaks after its first chunk."""
    cloud.control(**control)
    out = tmp_path / "broken.json"
    r = bench(*target(cloud), "-c", "1", "-n", "2", "--output-len", "8", "--json", out)
    assert r.exit_code == 1, r.output
    assert "no level meets" in r.output
    assert json.loads(out.read_text())["levels"][0]["errors"] == {kind: 2}


def test_a_refused_preflight_stops_the_run(cloud):
    cloud.control(fail=[{"status": 401, "body": {"error": {"code": "invalid_api_key", "message": "no"}}}])
    r = bench(*target(cloud), "-c", "1", "-n", "1")
    assert r.exit_code == 1 and "http_401:invalid_api_key" in r.output and "--api-key-env" in r.output


@pytest.fixture(scope="module")
def tls_cloud(tmp_path_factory):
    """The fake cloud over HTTPS with a self-signed certificate made by the openssl CLI at test time."""
    from tests.helpers.fake_cloud import FakeCloud

    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    fc = FakeCloud(d, tls=(str(cert), str(key))).start()
    yield fc, cert
    fc.stop()


def test_https_with_a_private_ca(tls_cloud):
    fc, cert = tls_cloud
    untrusted = bench("--url", fc.base, "--model", "m", "-c", "1", "-n", "1", "--warmup", "0")
    assert untrusted.exit_code == 1 and "connection" in untrusted.output
    r = bench("--url", fc.base, "--model", "m", "-c", "1", "-n", "2", "--warmup", "0", "--ca-file", cert)
    assert r.exit_code == 0, r.output


def test_unreachable_server_is_an_error_not_a_crash():
    r = bench("--url", f"http://127.0.0.1:{free_port()}", "--model", "m", "-c", "1", "-n", "1")
    assert r.exit_code == 1 and "is the server running" in r.output and "Traceback" not in r.output


def test_installed_script_help_and_invalid_input():
    h = subprocess.run([SCRIPT, "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--burst" in h.stdout and "--mix-ratio" in h.stdout
    p = subprocess.run(
        [SCRIPT, "bench", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "0,x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: --concurrency: ") and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "1", "--concurrency", "2"],
        ["--dataset", "no.jsonl"],
        ["--api-key-env", "SURELY_UNSET_VAR_42"],
        ["--burst", "3x:10s"],
        ["--chart", "out.gif"],
        ["--sla-from", "missing.yaml"],
        ["--compare", "missing.json"],
        ["--duration", "forever"],
        ["--mix", "1500"],
        ["--json", "no/such/dir/x.json"],
        ["--max-inflight", "0"],
        ["--ca-file", "missing.pem"],
    ],
)
def test_invalid_input_exits_2_before_sending_anything(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = bench("--url", "http://127.0.0.1:9", "--model", "m", *args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and "Traceback" not in r.output
