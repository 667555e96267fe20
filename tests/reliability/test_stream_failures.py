"""Streams that break after their first token: a cut cloud stream says `upstream_stream_cut` (it said
`upstream_unavailable`, "could not reach"), and with `routing.continue_on_failure: cloud` a local stream whose
engine is killed mid-way is finished by the cloud, marked, with no failed request (2 of 689 failed before)."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.reliability.conftest import local_first_spec, start_engine, token_table
from tests.router.conftest import (
    ALIAS,
    CLIENT_KEY,
    chat_body,
    client,
    cloud_url,
    make_spec,
    sse_events,
    wait_until,
)

CUT = {"llmdeploy": {"continued_on": "cloud", "failed": "local"}}


def test_a_cloud_stream_cut_midway_ends_with_upstream_stream_cut(fakes, start_router, access_log):
    cloud, _ = fakes
    cloud.control(cut_after=2)
    rs = start_router(make_spec(cloud_url(cloud)), [])  # no engine: the cloud serves
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body(stream=True), headers={"x-request-id": "cut-1"})
    events = sse_events(r)
    assert r.headers["x-llmdeploy-backend"] == "cloud" and events[-1] == "[DONE]"
    (err,) = [e["error"] for e in events[:-1] if "error" in e]
    assert err["code"] == "upstream_stream_cut" and "cut" in err["message"]
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-1] if e.get("choices"))
    assert any("rid=cut-1" in line and "error=stream_cut" in line for line in access_log())


class Stream:
    """A stream read in a thread; `chunks` grows as content arrives."""

    def __init__(self, url: str, body: dict, **headers: str):
        self.events: list = []
        self.chunks = 0
        self.thread = threading.Thread(target=self._read, args=(url, body, headers), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict, extra: dict[str, str]) -> None:
        headers = {"authorization": f"Bearer {CLIENT_KEY}", **extra}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.chunks += 1

    def text(self) -> str:
        return "".join(
            (e["choices"][0].get("delta") or {}).get("content") or ""
            for e in self.events
            if isinstance(e, dict) and e.get("choices")
        )


def test_kill_9_mid_stream_is_finished_by_the_cloud_when_allowed(
    fakes, start_router, tiny_llama, tmp_path, access_log
):
    cloud, _ = fakes
    proc, url = start_engine(tiny_llama, tmp_path / "victim.log")
    try:
        spec_on = local_first_spec(cloud_url(cloud), routing={"continue_on_failure": "cloud"})
        on = start_router(spec_on, [url], table=token_table([url], None))
        off = start_router(local_first_spec(cloud_url(cloud)), [url], table=token_table([url], None))
        # as long as the engine's 1024-token context allows: the tiny model decodes a token in well under a
        # millisecond, and every stream must still be running when the kill lands
        body = chat_body(max_tokens=1000, ignore_eos=True, temperature=0, stream=True)
        local_only = {"x-llmdeploy-allow-cloud": "false"}  # this request's data must not leave the machine
        streams = [
            Stream(on.url, body),
            Stream(on.url, body),
            Stream(off.url, body),
            Stream(on.url, body, **local_only),
        ]
        started = wait_until(lambda: all(s.chunks >= 3 for s in streams), timeout_s=120, every_s=0.002)
        assert started, "no tokens came"
        assert not any(s.events and s.events[-1] == "[DONE]" for s in streams), "a stream ended too soon"
        proc.stop(sig=signal.SIGKILL)
        for s in streams:
            s.thread.join(60)
        after = [c.post("/v1/chat/completions", json=chat_body(stream=True)) for c in (client(on),)]
    finally:
        proc.stop()
    for s in streams[:2]:  # continued: complete, no error event, the rest marked as the cloud's
        assert s.events[-1] == "[DONE]" and not any("error" in e for e in s.events[:-1])
        marked = [e for e in s.events[:-1] if e.get("llmdeploy") == CUT["llmdeploy"]]
        assert marked and all(e["model"] == ALIAS for e in marked)
        assert s.text().endswith("cloud")  # the fake cloud's reply closes it
    for broken in streams[2:]:  # continuation off (the default), or the cloud not allowed: a clear error
        assert broken.events[-1] == "[DONE]"
        assert [e["error"]["code"] for e in broken.events[:-1] if "error" in e] == ["upstream_stream_cut"]
    assert all(r.status_code == 200 for r in after)
    prefixes = [r["body"]["messages"][-1] for r in cloud.requests() if r["stream"]]
    assert sum(bool(m["role"] == "assistant" and m["content"]) for m in prefixes) == 2  # the text so far
    assert len([line for line in access_log() if "continued=cloud" in line and "status=200" in line]) == 2
