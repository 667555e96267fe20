"""Request fields for structured output and tool calling, as OpenAI (and vLLM, for guided_*) name them.

Checked where both servers parse a request, so a malformed tool or schema is a 400 naming its `param`
at the router already, before any backend is chosen.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS = 128
MAX_CHOICES = 256


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ImageURL(_Tolerant):
    url: str
    detail: str | None = None


class ImagePart(_Tolerant):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionDef(_Tolerant):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Tolerant):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Tolerant):
    name: str


class NamedToolChoice(_Tolerant):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Tolerant):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Tolerant):
    """A call in an assistant message sent back by the client (the conversation's history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class JsonSchemaFormat(_Tolerant):
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Tolerant):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class GuidedFields(BaseModel):
    """vLLM's constrained-decoding extensions (sent with the SDK's extra_body); at most one of them."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    logit_bias: dict[str, float] | None = None

    @field_validator("guided_regex", "guided_choice")
    @classmethod
    def _one_guide(cls, v: Any, info: ValidationInfo) -> Any:
        before = [n for n in ("guided_json", "guided_regex") if info.data.get(n) is not None]
        if v is not None and before:
            raise ValueError(
                f"give only one of guided_json, guided_regex, guided_choice (also got {before[0]})"
            )
        if info.field_name == "guided_choice" and v is not None and any(not c for c in v):
            raise ValueError("choices must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key[:32]!r}")
            if not -100 <= bias <= 100:
                raise ValueError("values must be between -100 and 100")
        return v

    @property
    def guided_fields(self) -> list[str]:
        return [n for n in ("guided_json", "guided_regex", "guided_choice") if getattr(self, n) is not None]


class ToolFields(BaseModel):
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_matches_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if choice == "required" and not names:
            raise ValueError('"required" needs at least one tool in tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names function {choice.function.name!r}, which is not in tools")
        return choice

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """What the tools ask of the output; "none" also when no tools are given."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"
