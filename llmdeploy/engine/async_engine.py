"""AsyncLLMEngine: the step loop runs on its own thread, off the asyncio event loop; outputs reach each request's
asyncio.Queue through loop.call_soon_threadsafe (one call per step).

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
from llmdeploy.engine.errors import RequestFailedError
from llmdeploy.engine.llm_engine import LLMEngine
from llmdeploy.engine.loader import LoadedModel
from llmdeploy.engine.outputs import EngineStats, RequestOutput
from llmdeploy.engine.sampling_params import SamplingParams

log = logging.getLogger("llmdeploy.engine")
ABORTED = object()  # queue item: the request was aborted from outside its generator
IDLE_WAIT_S = 0.5


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.engine = LLMEngine(config, loaded)
        self.config, self.tokenizer, self.arch = self.engine.config, self.engine.tokenizer, self.engine.arch
        self.capacity = self.engine.capacity
        runner = self.engine.runner
        self.dtype, self.device = runner.dtype, runner.device
        self.kernel_backend = runner.model.attention_layers()[0].ops.__name__.rsplit(".", 1)[-1]
        self._queues: dict[str, asyncio.Queue] = {}
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
        for rid, q in list(self._queues.items()):
            self.engine.abort(rid)
            q.put_nowait(RequestFailedError("the engine shut down"))

    # requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        if not self.running or self._loop is not asyncio.get_running_loop():
            await self.start()
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self.engine.add_request(rid, prompt_token_ids, params)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._wake.set()
        done = False
        try:
            while True:
                item = await queue.get()
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
            self._queues.pop(rid, None)
            if not done:
                self.engine.abort(rid)

    async def abort(self, request_id: str) -> bool:
        aborted = self.engine.abort(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(ABORTED)
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
                with engine.lock:
                    for req in list(engine.requests.values()):
                        engine._fail(req, exc)
            failures = engine.pop_failures()
            if outputs or failures:
                try:
                    self._loop.call_soon_threadsafe(self._deliver, outputs, failures)
                except RuntimeError:  # the event loop is gone: nobody can read these requests any more
                    for out in outputs:
                        engine.abort(out.request_id)

    def _deliver(self, outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for rid, exc in failures:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(exc)
