"""What this engine can give a request, as the router reads it from /load (`capabilities`,
policies/capability.py): the loaded model's family and the engine's own features."""

from __future__ import annotations

import importlib.util
from typing import Any

from llmdeploy.engine.sampling_params import MAX_LOGPROBS
from llmdeploy.policies.capability import Capabilities

ENGINE_FEATURES = ("logit_bias", "logprobs", "best_of", "echo_logprobs")
GRAMMAR_FEATURES = ("json_object", "json_schema", "guided_json", "guided_regex", "guided_choice")


def engine_capabilities(tokenizer: Any, max_model_len: int) -> Capabilities:
    features = set(ENGINE_FEATURES)
    if importlib.util.find_spec("llguidance") is not None:  # the grammar library (engine/guided.py)
        features.update(GRAMMAR_FEATURES)
    if getattr(tokenizer, "chat_template", None):
        features.add("tools")  # any chat model: its template's format, or the generic one (tool_calls.py)
    return Capabilities(frozenset(features), max_model_len, MAX_LOGPROBS)
