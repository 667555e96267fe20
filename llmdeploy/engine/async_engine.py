"""AsyncLLMEngine: the step loop runs on its own thread, off the asyncio event loop; outputs reach each request's
OutputStream through loop.call_soon_threadsafe (one call per step).

generate() is an async generator: when its consumer stops (aclose, task cancelled, client gone) the request is
aborted and its blocks freed at once. No request can crash or stall the loop: a failure in one request's
processing fails that request, a model error fails the requests of that step, and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.errors import ParamError, RequestFailedError
from llmdeploy.engine.llm_engine import LLMEngine
from llmdeploy.engine.loader import LoadedModel
from llmdeploy.engine.outputs import EngineStats, RequestOutput
from llmdeploy.engine.sampling_params import SamplingParams

log = logging.getLogger("llmdeploy.engine")
ABORTED = object()  # queue item: the request was aborted from outside its generator
IDLE_WAIT_S = 0.5


class OutputStream:
    """One request's outputs on the event loop. A consumer that falls behind gets one merged output (deltas
    joined), never a growing backlog of cumulative copies."""

    def __init__(self) -> None:
        self.pending: RequestOutput | None = None
        self.end: object | None = None  # ABORTED or the exception that ends the stream
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else merge_outputs(self.pending, out)
        self.ready.set()

    def close(self, end: object) -> None:
        self.end = self.end or end
        self.ready.set()

    async def get(self) -> object:
        while True:
            if self.pending is not None:
                out, self.pending = self.pending, None
                return out
            if self.end is not None:
                return self.end
            self.ready.clear()
            await self.ready.wait()


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new` (cumulative fields are already complete) with the deltas of `old` put in front of its own."""
    before = {c.index: c for c in old.outputs}
    for c in new.outputs:
        p = before.get(c.index)
        if p is not None:
            c.delta_text = p.delta_text + c.delta_text
            c.delta_token_ids = p.delta_token_ids + c.delta_token_ids
            if c.delta_logprobs is not None:
                c.delta_logprobs = (p.delta_logprobs or []) + c.delta_logprobs
    return new


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.engine = LLMEngine(config, loaded)
        self.config, self.tokenizer, self.arch = self.engine.config, self.engine.tokenizer, self.engine.arch
        self.capacity = self.engine.capacity
        runner = self.engine.runner
        self.dtype, self.device = runner.dtype, runner.device
        self.kernel_backend = runner.kernel_backend
        self._streams: dict[str, OutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # outputs go to the loop that serves the requests
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llmdeploy-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.close(RequestFailedError("the engine shut down"))

    # requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        check: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """check=False: the caller already ran check_request on this prompt and these params."""
        if not self.running or self._loop is not asyncio.get_running_loop():
            await self.start()
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ParamError("request_id", f"Request id {rid!r} is already in use.")
        stream = self._streams[rid] = OutputStream()
        try:
            self.engine.add_request(rid, prompt_token_ids, params, check=check)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        self._wake.set()
        done = False
        try:
            while True:
                item = await stream.get()
                if item is ABORTED:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not done:
                self.engine.abort(rid)

    async def abort(self, request_id: str) -> bool:
        aborted = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close(ABORTED)
        return aborted

    # observability
    def load(self) -> dict[str, Any]:
        return self.engine.load(ready=self.running)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # the loop thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.clear()
            if not engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug outside the forward: fail what is in flight, keep serving
                log.exception("engine step failed")
                outputs = []
                engine.fail_all(exc)
            failures = engine.pop_failures()
            if outputs or failures:
                try:
                    self._loop.call_soon_threadsafe(self._deliver, outputs, failures)
                except RuntimeError:  # the event loop is gone: nobody can read these requests any more
                    for out in outputs:
                        engine.abort(out.request_id)

    def _deliver(self, outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        for rid, exc in failures:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.close(exc)
