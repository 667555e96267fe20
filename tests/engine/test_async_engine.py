"""AsyncLLMEngine: the step loop on its own thread, per-request queues, cancel frees at once, faults stay local."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmdeploy.engine import AsyncLLMEngine, EngineConfig, SamplingParams
from llmdeploy.engine.errors import ContextLengthError, ParamError, RequestFailedError
from llmdeploy.engine.llm_engine import LLMEngine
from tests.engine.test_engine_parity import hf_greedy, prompts

LOAD_KEYS = {
    "decoding",
    "ttft_ms_by_prompt_len",
    "ttft_sla_ms",
    "deadline_ms_by_prompt_len",
    "ttft_by_class",
    "step_cost",
    "prompt_size",
    "dtype",
    "dtype_reason",
    "quantization",
    "capabilities",
    "resources",
    "decode_step_ms_by_batch",
    "max_num_batched_tokens",
    "waiting",
    "running",
    "free_blocks",
    "total_blocks",
    "block_size",
    "pending_prefill_tokens",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "predicted_queue_wait_ms",
    "kv_usage",
    "max_model_len",
    "max_num_seqs",
    "num_preemptions",
    "ready",
}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return AsyncLLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def collect(engine, ids, params, rid):
    outs = [o async for o in engine.generate(ids, params, rid)]
    return outs


def all_free(engine) -> bool:
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.engine.scheduler.has_unfinished()


def test_concurrent_generate_matches_transformers(engine, tiny_llama):
    batch = prompts(8, seed=21, lo=3, hi=50)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def main():
        await engine.start()
        return await asyncio.gather(*(collect(engine, p, params, f"c{i}") for i, p in enumerate(batch)))

    results = run(main())
    for p, outs in zip(batch, results, strict=True):
        final = outs[-1]
        assert final.finished and final.outputs[0].token_ids == hf_greedy(tiny_llama, p, 16)
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.outputs[0].token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == final.outputs[0].text
        assert not any(o.finished for o in outs[:-1])
    assert all_free(engine)


def test_a_slow_consumer_gets_merged_outputs(engine, tiny_llama):
    p = prompts(1, seed=26)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)

    async def main():
        await engine.start()
        agen = engine.generate(p, params, "slow")
        outs = [await agen.__anext__()]
        while engine.engine.requests.get("slow") is not None:  # let the engine run ahead of us
            await asyncio.sleep(0.01)
        outs += [o async for o in agen]
        return outs

    outs = run(main())
    final = outs[-1].outputs[0]
    assert len(outs) < 30 and final.token_ids == hf_greedy(tiny_llama, p, 30)
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert [lp for o in outs for lp in o.outputs[0].delta_logprobs] == final.logprobs
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text


def test_closing_the_stream_aborts_and_frees_blocks_at_once(engine):
    async def main():
        await engine.start()
        agen = engine.generate(
            prompts(1, seed=22, lo=40, hi=40)[0], SamplingParams(max_tokens=200, ignore_eos=True), "closed"
        )
        first = await agen.__anext__()
        assert not first.finished and engine.engine.block_manager.num_free_blocks < engine.capacity.num_blocks
        await agen.aclose()
        return all_free(engine), engine.stats().num_requests_aborted

    freed, aborted = run(main())
    assert freed and aborted >= 1


def test_cancelled_task_aborts_and_frees_blocks_at_once(engine):
    async def main():
        await engine.start()
        got_one = asyncio.Event()

        async def consume():
            async for _ in engine.generate(
                prompts(1, seed=23)[0], SamplingParams(max_tokens=200, ignore_eos=True), "cancelled"
            ):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return all_free(engine)

    assert run(main())


def test_abort_ends_the_stream(engine):
    async def main():
        await engine.start()
        agen = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "aborted")
        await agen.__anext__()
        assert await engine.abort("aborted")
        rest = [o async for o in agen]
        return rest, all_free(engine)

    rest, freed = run(main())
    assert freed and len(rest) <= 2  # at most what was already delivered


def test_bad_requests_are_rejected_before_queueing(engine):
    async def main():
        await engine.start()
        with pytest.raises(ParamError) as e:
            await collect(engine, [1, 2], SamplingParams(temperature=-1), "bad-param")
        assert e.value.param == "temperature"
        with pytest.raises(ContextLengthError):
            await collect(engine, [1] * 250, SamplingParams(max_tokens=10), "too-long")
        with pytest.raises(ParamError) as e:
            engine.check_request([10**7], SamplingParams())
        assert e.value.param == "prompt"
        ok = await collect(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), "after")
        return ok[-1]

    out = run(main())
    assert len(out.outputs[0].token_ids) == 3


def test_a_request_that_fails_in_processing_fails_alone(engine, tiny_llama):
    inner = engine.engine
    original = inner._finish_reason

    def faulty(seq, token):
        if seq.request_id == "poison":
            raise ValueError("boom")
        return original(seq, token)

    good_prompt = prompts(1, seed=24)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        await engine.start()
        bad = asyncio.create_task(collect(engine, [4, 5, 6], params, "poison"))
        good = asyncio.create_task(collect(engine, good_prompt, params, "fine"))
        return await asyncio.gather(bad, good, return_exceptions=True)

    inner._finish_reason = faulty
    try:
        bad, good = run(main())
    finally:
        inner._finish_reason = original
    assert isinstance(bad, RequestFailedError) and "boom" in str(bad)
    assert good[-1].outputs[0].token_ids == hf_greedy(tiny_llama, good_prompt, 12)
    assert all_free(engine)


def test_a_model_error_fails_the_step_and_the_loop_keeps_serving(engine):
    runner = engine.engine.runner
    original = runner.run
    calls = {"n": 0}

    def broken_once(batch, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return original(batch, *a, **kw)

    async def main():
        await engine.start()
        with pytest.raises(RequestFailedError):
            await collect(engine, [7, 8, 9], SamplingParams(max_tokens=4), "victim")
        after = await collect(engine, [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True), "survivor")
        return after[-1]

    runner.run = broken_once
    try:
        out = run(main())
    finally:
        runner.run = original
    assert out.finished and len(out.outputs[0].token_ids) == 4
    assert engine.stats().num_requests_failed >= 1 and all_free(engine)


def test_load_and_stats(engine):
    async def main():
        await engine.start()
        await asyncio.to_thread(
            lambda: engine.engine.guided.available
        )  # ready waits for the grammar backend too
        load = engine.load()
        await collect(engine, [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True), "counted")
        return load, engine.stats(), engine.load()

    before, stats, after = run(main())
    assert set(before) == LOAD_KEYS and before["ready"] is True
    assert after["waiting"] == after["running"] == 0 and after["free_blocks"] == after["total_blocks"]
    assert after["prefill_tokens_per_s"] > 0 and after["decode_tokens_per_s"] > 0
    assert after["block_size"] == 16 and after["max_model_len"] == 256
    assert stats.generation_tokens_total >= 5 and stats.prompt_tokens_total >= 4
    assert engine.capacity.tokens == engine.capacity.num_blocks * 16


def test_load_counts_waiting_work(tiny_llama):
    from llmdeploy.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01, max_num_seqs=2)
    )
    for i in range(4):
        engine.add_request(f"r{i}", list(range(3, 53)), SamplingParams(max_tokens=20))
    load = engine.load()
    assert (
        load["waiting"] == 4 and load["pending_prefill_tokens"] == 200 and load["predicted_queue_wait_ms"] > 0
    )
    engine.step()
    load = engine.load()
    assert load["running"] == 2 and load["waiting"] == 2 and load["pending_prefill_tokens"] == 100
    assert engine.abort("r0") and engine.abort("r3") and not engine.abort("r3")
    assert engine.load()["running"] == 1


def test_fail_ends_requests_with_an_error_and_frees_their_blocks(tiny_llama):
    from llmdeploy.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=20))
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=20))
    engine.step()
    assert engine.fail("a", ValueError("boom")) and not engine.fail("a", ValueError("again"))
    [(rid, err)] = engine.pop_failures()
    assert rid == "a" and isinstance(err, RequestFailedError) and "ValueError: boom" in str(err)
    assert "a" not in engine.requests and engine.stats().num_requests_failed == 1
    down = RequestFailedError("the engine is down")
    engine.fail_all(down)
    assert engine.pop_failures() == [("b", down)] and engine.stats().num_requests_failed == 2
    bm = engine.block_manager
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_shutdown_fails_open_streams(tiny_llama):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))

    async def main():
        await engine.start()
        agen = engine.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), "open")
        await agen.__anext__()
        await engine.shutdown()
        with pytest.raises(RequestFailedError):
            async for _ in agen:
                pass
        return engine.load()["ready"]

    assert run(main()) is False


def test_an_abort_during_the_forward_fails_nothing_else(tiny_llama):
    """The forward runs outside the engine's lock, so an abort then frees the request's blocks at once. The step's
    inputs must be read from the block tables before: a decode's slot read after the abort raised IndexError and
    failed the whole batch (found by the 1,000-request mixed run with cancellations)."""
    eng = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kept = prompts(1, seed=24)[0]
    eng.add_request("stays", kept, params)
    eng.add_request("leaves", [4, 5, 6], params)
    eng.step()  # both prompts computed: the next step decodes both
    runner = eng.runner

    def abort_mid(forward):  # an ordinary step's or a native call's (a burst, a screened greedy step)
        def run(batch, *a, **kw):
            other = threading.Thread(
                target=eng.abort, args=("leaves",)
            )  # the server's thread, as on a disconnect
            other.start()
            other.join(10)
            return forward(batch, *a, **kw)

        return run

    runner.run, runner.run_burst = abort_mid(runner.run), abort_mid(runner.run_burst)
    finished = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        if not eng.has_unfinished():
            break
    assert not eng.pop_failures() and eng.stats().num_requests_failed == 0
    assert list(finished) == ["stays"] and finished["stays"].outputs[0].token_ids == hf_greedy(
        tiny_llama, kept, 6
    )
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_not_ready_until_the_grammar_backend_has_started(tiny_llama, monkeypatch):
    """Its start-up thread holds the GIL and a core: a first request beside it took 10x its step on 2 cores, so
    /load (and /health, which reads it) says not ready until it is done, built or failed."""
    from llmdeploy.engine.guided import GrammarBackend

    release = threading.Event()
    build = GrammarBackend._build
    monkeypatch.setattr(GrammarBackend, "_build", lambda self, tok: release.wait(60) and build(self, tok))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))
    assert engine.load()["ready"] is False and not engine.guided.settled
    release.set()
    assert engine.guided.available  # waits for the thread
    assert engine.load()["ready"] is True
    assert engine.load(ready=False)["ready"] is False
