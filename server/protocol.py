"""Request and response bodies of the OpenAI-compatible subset that `dspark-serve` speaks.

Requests are strict: an unknown field is a 400 naming it, wrong JSON types are never coerced
("5" is not an int), and OpenAI fields this server does not implement (`logprobs`, `tools`, `best_of`, `suffix`,
penalties, ...) are accepted only at their neutral value, so a client never silently gets something
other than what it asked for. Extensions beyond OpenAI: `top_k`, `stop_token_ids`,
`return_token_ids` (vLLM's names) and the `metrics` field of every response.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema,
                      field_validator, model_serializer)

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # `n`: completions per request, each an engine request of its own
_UINT64 = 2**64
# The sampler computes in float32: a positive temperature or top_p below float32's smallest normal
# number underflows to 0 there (NaN probabilities, an empty nucleus), so such values are refused.
FLOAT32_TINY = 1.1754943508222875e-38


def _valid_unicode(text: str) -> str:
    # JSON escapes can smuggle lone surrogates ("\ud800") that no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate escape; text must be valid Unicode") from None
    return text


Text = Annotated[str, Field(strict=True), AfterValidator(_valid_unicode)]


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string or a list of token ids, optionally wrapped in a one-element list."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise ValueError("only one prompt per request is supported; send one request per prompt")
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return _valid_unicode(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not value:
            raise ValueError("must not be empty")
        return value
    raise ValueError("must be a string or a list of token ids")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return [_valid_unicode(s) for s in stops]


def _content(value: Any) -> str:
    """Message content: a string or a list of text parts (joined by newlines)."""
    if isinstance(value, str):
        return _valid_unicode(value)
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of text parts")
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text parts {'type': 'text', 'text': ...} are supported")
        if set(part) - {"type", "text"}:
            raise ValueError(f"unknown key in text part: {sorted(set(part) - {'type', 'text'})[0]!r}")
        texts.append(_valid_unicode(part["text"]))
    return "\n".join(texts)


_STRING_OR_IDS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
Prompt = Annotated[str | list[int], BeforeValidator(_prompt), WithJsonSchema(_STRING_OR_IDS)]
Stop = Annotated[list[str], BeforeValidator(_stop), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})]
Content = Annotated[str, BeforeValidator(_content), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]})]

# OpenAI fields this server does not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
}


def _same(value: Any, neutral: Any) -> bool:
    # `True == 1` in Python: a bool must not pass for a number (`n: true`), nor a number for a bool.
    if isinstance(neutral, bool) or isinstance(value, bool) or neutral is None:
        return value is neutral
    if isinstance(neutral, int):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _neutral_only(value: Any, info) -> Any:
    if not any(_same(value, ok) for ok in _NEUTRAL[info.field_name]):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{info.field_name}={shown} is not supported by this server")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, strict=True)


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    max_tokens: int | None = Field(None, strict=True, ge=1)
    temperature: float = Field(1.0, strict=True, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, strict=True, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, strict=True, ge=-1, description="extension; 0 or -1 disables it")
    seed: int | None = Field(None, strict=True, ge=0, lt=_UINT64)
    stop: Stop = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    user: Text | None = None
    return_token_ids: bool = Field(False, strict=True, description="extension: token ids in each choice")
    n: int = Field(1, strict=True, ge=1, le=MAX_CHOICES,
                   description="choices to generate; with a seed, choice i samples with seed + i")

    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    _check_neutral = field_validator("best_of", "logprobs", "top_logprobs", "presence_penalty",
                                     "frequency_penalty", "logit_bias")(_neutral_only)

    @field_validator("temperature", "top_p")
    @classmethod
    def _representable_in_float32(cls, value, info):
        if 0 < value < FLOAT32_TINY:
            raise ValueError(f"must be 0 or at least {FLOAT32_TINY:.3g}" if info.field_name == "temperature"
                             else f"must be at least {FLOAT32_TINY:.3g}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream=true")
        return value

    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, strict=True, ge=1)  # OpenAI's default for completions
    echo: bool = Field(False, strict=True, description="the prompt's text before each choice's")
    suffix: Any = None

    _check_neutral_completion = field_validator("suffix")(_neutral_only)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: Text | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, strict=True, ge=1, description="alias of max_tokens")
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None

    _check_neutral_chat = field_validator("tools", "tool_choice", "functions", "function_call",
                                          "parallel_tool_calls", "response_format")(_neutral_only)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses -------------------------------------------------------------------------------------


class _Out(BaseModel):
    """Response model that leaves out the optional extension fields when they are unset, while
    keeping OpenAI's own nullable fields (`finish_reason`, `logprobs`) as explicit nulls."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(self, handler):
        data = handler(self)
        for key in self._omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeMetrics(BaseModel):
    """Per-request speculative decoding figures (GenerationStats); a verify step is one round.

    mean_acceptance_length is τ: tokens committed per verify step, bonus token included, the first
    token (from the prefill call) excluded. per_position_accepted[k] counts steps whose k-th draft
    was accepted.
    """

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    per_position_accepted: list[int]


class RequestMetrics(BaseModel):
    speculative_decoding: SpeculativeMetrics
    time_to_first_token_s: float | None
    e2e_latency_s: float


class CompletionChoice(_Out):
    _omit_if_none = ("token_ids", "prompt_token_ids")
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Out):
    _omit_if_none = ("usage", "metrics")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | None = None


class ChatMessageOut(_Out):
    _omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = "assistant"
    content: str | None = None


class ChatChoice(_Out):
    _omit_if_none = ("message", "delta", "token_ids", "prompt_token_ids")
    index: int = 0
    message: ChatMessageOut | None = None
    delta: ChatMessageOut | None = None
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(_Out):
    _omit_if_none = ("usage", "metrics")
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
