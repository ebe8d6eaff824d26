"""The OpenAI HTTP schema at the server's edge: pydantic models of the requests (validated,
unknown fields refused by name) and the response bodies and stream chunks as plain dicts
(built per token while streaming, so no model is validated on the way out).

Fields are OpenAI's; `return_token_ids` and `chat_template_kwargs` are vLLM's. A field that
would change the output and is not implemented (penalties, `logit_bias`, a JSON
`response_format`, forced tool choice, `echo`) is refused rather than ignored.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxrl_scale.serve.backend import MAX_TOP_LOGPROBS

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_N = 128


class FieldError(ValueError):
    """A check across fields, naming the one at fault (pydantic gives such checks no place)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message. Keys beyond OpenAI's (an SDK's `refusal: null`, a template's own) pass
    through to the chat template; keys whose value is null are dropped."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined, a developer message as
        a system one, tool-call arguments as objects (the published templates `tojson` them),
        no content as "" (an assistant's calls)."""
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", "")  # an assistant's calls without text: the templates read it
        if out["role"] == "developer":
            out["role"] = "system"
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    **({"id": c.id} if c.id else {}),
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"tool call {call.function.name!r}: arguments are not JSON ({e})"
        ) from None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Strict):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolName


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


def _check_stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("a stop string is empty")
    return stops


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids, and token_ids per choice
    user: str | None = None  # accepted; it changes nothing here
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        _check_stop(stop)
        return stop

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def stops(self) -> list[str]:
        return _check_stop(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        return self


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | NamedToolChoice | Literal["required"] | None = None
    parallel_tool_calls: bool | None = None  # false: the first call only
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. enable_thinking

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        forced = self.forced_tool
        if forced is None:
            return self
        if not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        names = [t.function.name for t in self.tools]
        if forced and forced not in names:
            raise FieldError("tool_choice", f"no tool named {forced!r} (tools: {names})")
        return self

    @property
    def forced_tool(self) -> str | None:
        """ "" when a call must be made (tool_choice "required"), the function's name when a
        named one, None when the model chooses or no tool is called."""
        if self.tool_choice == "required":
            return ""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default here
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and any(i < 0 for i in prompt):
            raise ValueError("token ids are >= 0")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of other than n is not supported")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_tokens


# --------------------------------------------------------------------------- responses


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def envelope(rid: str, obj: str, model: str, choices: list, **extra) -> dict[str, Any]:
    """A response or a stream chunk: its id, kind, time, model and choices."""
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def models_list(name: str, context: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "jaxrl-scale",
                "max_model_len": context,
            }
        ],
    }
