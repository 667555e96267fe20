"""The metrics probe reads a router's view of its engines, and never counts an engine twice."""

from __future__ import annotations

from llmdeploy.loadgen.probe import combine, read_gauges
from llmdeploy.router.metrics import RouterMetrics


def router_text() -> str:
    m = RouterMetrics()
    for replica, (kv, waiting, running) in {"r1": (0.25, 3, 8), "r2": (0.5, 1, 4)}.items():
        m.engine_kv.labels("1", replica).set(kv)
        m.engine_waiting.labels("1", replica).set(waiting)
        m.engine_running.labels("1", replica).set(running)
    m.inflight.set(12)
    return m.render().decode()


ENGINE = """# TYPE llmdeploy:kv_cache_usage_perc gauge
llmdeploy:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE llmdeploy:num_requests_waiting gauge
llmdeploy:num_requests_waiting{model_name="m"} 3
# TYPE llmdeploy:num_requests_running gauge
llmdeploy:num_requests_running{model_name="m"} 8
"""


def test_router_alone_gives_its_engines_figures():
    got = combine([read_gauges(router_text())])
    assert got == {"kv_usage": 0.5, "waiting": 4, "running": 12, "router_inflight": 12}


def test_an_engine_scraped_directly_wins_over_the_routers_view():
    got = combine([read_gauges(router_text()), read_gauges(ENGINE)])
    assert got == {"kv_usage": 0.25, "waiting": 3, "running": 8, "router_inflight": 12}
