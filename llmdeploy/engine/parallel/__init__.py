"""Tensor parallelism (`parallel.tensor_parallel: N`): one engine endpoint, N processes, torch.distributed.

Rank 0 is the engine process the supervisor starts: it runs the HTTP server, the scheduler and the sampler, and
spawns ranks 1..N-1 (`python -m llmdeploy.engine.parallel.worker`, leader.py). Every step it broadcasts the
step's inputs (token ids, positions, slot mapping, block tables, block copies; step.py) and all ranks run the
forward together: q/k/v and gate/up are split by output rows (whole heads per rank), o and down by input columns
with a sum across ranks after them (llama.py), and each rank's KV cache holds only its KV heads for the same block
ids, so the block manager on rank 0 serves all. Embeddings and the LM head are replicated: rank 0 alone turns
hidden states into logits (sampling, prompt logprobs, logit bias and guided decoding need the whole vocabulary
there), which a vocabulary split would pay for with a gather per step and a collective per prompt-logprob slice.

With tensor_parallel 1 nothing here is imported by the step path: no process group, no broadcast, no copies.
"""
