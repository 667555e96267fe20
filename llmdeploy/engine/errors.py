"""Engine-level errors: plain exceptions; the server maps them to OpenAI errors (openai_api/errors.py)."""

from __future__ import annotations

# the engine's exit status when its model or options cannot work (sysexits' EX_CONFIG): a restart would fail the
# same way, so the supervisor gives up on a replica that never became ready instead of retrying it
CANNOT_LOAD_EXIT = 78


class EngineError(Exception):
    """Base of the engine's own errors."""


class ParamError(EngineError, ValueError):
    """A bad sampling parameter; `param` is the OpenAI request field that carries it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


class ContextLengthError(EngineError, ValueError):
    """prompt + max_tokens is longer than max_model_len (OpenAI: 400 context_length_exceeded)."""

    def __init__(self, message: str, num_prompt_tokens: int, max_model_len: int):
        super().__init__(message)
        self.message, self.num_prompt_tokens, self.max_model_len = message, num_prompt_tokens, max_model_len


class CapacityError(EngineError, ValueError):
    """The request can never fit in the whole KV cache, or the KV cache cannot hold one max_model_len sequence."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestFailedError(EngineError):
    """The engine failed this request (a model or processing error); other requests keep being served."""
