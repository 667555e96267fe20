"""One request's state in the engine (its sequences, metrics, what was handed out) and the RequestOutput built
from it after each step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmdeploy.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch
from llmdeploy.engine.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    emitted: dict[int, int] = field(default_factory=dict)  # seq index -> output tokens already handed out

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    def output(self, finished: bool) -> RequestOutput:
        """Cumulative fields plus the deltas since the previous output (which this marks as handed out)."""
        outs = [self._completion(seq) for seq in sorted(self.seqs, key=lambda s: s.index)]
        first = self.seqs[0]
        prompt_lps = first.prompt_logprobs
        if prompt_lps is not None and len(prompt_lps) < first.num_prompt_tokens:
            prompt_lps = None  # the prompt is not all prefilled yet
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            outs,
            finished,
            first.num_cached_tokens,
            replace(self.metrics),  # a snapshot: the engine goes on stamping its own
            list(prompt_lps) if prompt_lps is not None else None,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        detok = seq.detok
        delta_text = detok.emit(seq.is_finished) if detok else ""
        start = self.emitted.get(seq.index, 0)
        ids = seq.output_token_ids
        self.emitted[seq.index] = len(ids)
        lps = seq.logprobs
        return CompletionOutput(
            index=seq.index,
            text=detok.output_text if detok else "",
            token_ids=ids,
            logprobs=list(lps) if lps is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta_text,
            delta_token_ids=ids[start:],
            delta_logprobs=lps[start:] if lps is not None else None,
        )


def record_prompt_logprobs(batch: ScheduledBatch, found: dict[int, list[TokenLogprob]]) -> None:
    """Append each chunk's prompt logprobs to its sequence, once per position (a preempted sequence computes its
    prompt again; what it had recorded stays)."""
    for seq, _ in batch.prefills:
        lps = found.get(seq.seq_id)
        if lps is None or seq.prompt_logprobs is None:
            continue
        first_position = seq.num_computed_tokens + 1  # before postprocess: where this chunk started, + 1
        have = len(seq.prompt_logprobs)
        if have >= first_position:
            seq.prompt_logprobs.extend(lps[have - first_position :])
