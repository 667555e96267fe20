"""What a request asks of its output's form: the grammar to enforce (response_format, guided_*, forced tool
calls) and how tool calls are read back. Pure functions over the validated request."""

from __future__ import annotations

import json
from typing import Any

from llmdeploy.engine.guided import GuidedSpec
from llmdeploy.engine.tool_calls import ToolPlan, detect_tool_format, function_parameters, required_schema
from llmdeploy.openai_api.errors import invalid_request
from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest

Request = ChatCompletionRequest | CompletionRequest


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]


def tool_plan(req: ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    mode = req.tool_mode
    if mode == "none":
        return None
    named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    return ToolPlan(
        mode=mode,
        fmt=detect_tool_format(tokenizer),
        names=tuple(t.function.name for t in req.tools or []),
        named=named,
        parallel=req.parallel_tool_calls is not False,
    )


def _tools_spec(req: ChatCompletionRequest) -> GuidedSpec | None:
    tools = tool_dicts(req)
    if req.tool_mode == "named":
        name = req.tool_choice.function.name  # type: ignore[union-attr]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return GuidedSpec.json_schema(function_parameters(tool), "tool_choice", compact=True)
    if req.tool_mode == "required":
        schema = required_schema(tools, req.parallel_tool_calls is not False)
        return GuidedSpec.json_schema(schema, "tools", compact=True)
    return None


def _response_format_spec(req: ChatCompletionRequest) -> GuidedSpec | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    schema = rf.json_schema.schema_ if rf.json_schema is not None else None
    return GuidedSpec.json_schema(schema if schema is not None else {}, "response_format")


def _vllm_spec(req: Request) -> GuidedSpec | None:
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise invalid_request("guided_json must be a JSON schema.", param="guided_json") from None
        if not isinstance(schema, (dict, bool)):
            raise invalid_request("guided_json must be a JSON schema object.", param="guided_json")
        return GuidedSpec.json_schema(schema, "guided_json")
    if req.guided_regex is not None:
        return GuidedSpec("regex", req.guided_regex, "guided_regex")
    if req.guided_choice is not None:
        return GuidedSpec.choice(req.guided_choice)
    return None


def guided_spec(req: Request) -> GuidedSpec | None:
    """The one grammar this request's output must match, if any; two that could disagree are a 400."""
    specs: list[GuidedSpec] = []
    if isinstance(req, ChatCompletionRequest):
        specs += [s for s in (_tools_spec(req), _response_format_spec(req)) if s is not None]
    vllm = _vllm_spec(req)
    if vllm is not None:
        specs.append(vllm)
    if len(specs) > 1:
        raise invalid_request(
            f"{specs[1].param} cannot be combined with {specs[0].param}: the output can follow one format only.",
            param=specs[1].param,
        )
    return specs[0] if specs else None


def logit_bias(req: Request) -> dict[int, float] | None:
    """Token id -> bias; ids beyond the model's vocabulary are refused by the engine's check."""
    return {int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None
