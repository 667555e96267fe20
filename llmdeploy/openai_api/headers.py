"""llmdeploy's own response headers beside the OpenAI API, shared by the engine server and the router."""

from __future__ import annotations

# On a non-stream engine answer: milliseconds from the request's arrival at the engine to its first token (the
# slowest of a multi-prompt request). The client sees only the whole answer, but the router's TTFT windows, which
# judge a canary against its SLA, need the first token's time for non-stream traffic too.
ENGINE_TTFT_HEADER = "x-llmdeploy-engine-ttft-ms"

# The deployment's internal token: the daemon makes one at start and gives it to each engine it spawns in this
# environment variable; such an engine serves its /v1 routes (and /tokenize, /detokenize) only to requests that
# carry it in this header, which the router sends. An engine started by hand without the variable needs none.
ENGINE_TOKEN_ENV = "LLMDEPLOY_ENGINE_TOKEN"
ENGINE_TOKEN_HEADER = "x-llmdeploy-engine-token"
