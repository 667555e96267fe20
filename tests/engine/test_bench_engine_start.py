"""bench/engine_start.py on real engine processes over the tiny model: the first start keeps its start measures
(engine/start_measures.py) in the cache it is given, the restart reads them instead of measuring and writing them
again, and every phase the bench reports comes from a line the engine logs."""

from __future__ import annotations

import math
import os

from bench import engine_start


def test_the_restart_reads_what_the_first_start_kept(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "LLMDEPLOY_CACHE_DIR": str(engine_start.linked_cache(cache))}
    first = engine_start.start_once(str(tiny_llama), env)
    (kept,) = (cache / "measures").glob("*.json")
    written = kept.stat().st_mtime_ns
    again = engine_start.start_once(str(tiny_llama), env)
    assert kept.stat().st_mtime_ns == written  # read, not measured and written again
    for marks in (first, again):
        phases = engine_start.phases(marks)
        assert not any(math.isnan(s) for s in phases.values()), marks  # each mark was logged
        assert all(s >= 0 for s in phases.values()) and phases["ready"] > 0


def test_a_mark_an_older_engine_does_not_log_goes_to_the_next_phase():
    marks = {"imports": 3.0, "measures": 8.0, "serve": 8.5, "ready": 8.6}
    phases = engine_start.phases(marks)
    assert math.isnan(phases["load"]) and phases["measures"] == 5.0 and phases["ready"] == 8.6
