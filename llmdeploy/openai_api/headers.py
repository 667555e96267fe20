"""llmdeploy's own response headers beside the OpenAI API, shared by the engine server and the router."""

from __future__ import annotations

# On a non-stream engine answer: milliseconds from the request's arrival at the engine to its first token (the
# slowest of a multi-prompt request). The client sees only the whole answer, but the router's TTFT windows, which
# judge a canary against its SLA, need the first token's time for non-stream traffic too.
ENGINE_TTFT_HEADER = "x-llmdeploy-engine-ttft-ms"
