"""OpenAI's request and response shapes as pydantic models (vLLM's protocol.py), and the mapping
of a request's fields onto `SamplingParams`.

Requests ignore fields they do not know (OpenAI clients send extras, and OpenAI adds fields);
a known field with a wrong type or value is refused with a message naming it.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from pagedjax.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# OpenAI clamps logit biases to this range.
LOGIT_BIAS_LIMIT = 100.0


class ServingError(Exception):
    """A request the server refuses, answered with OpenAI's error JSON and `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code = type, code

    def response(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)


class OpenAIBaseModel(BaseModel):
    # NaN or inf in a sampling field would silently break sampling: refuse them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ----------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the served model
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's extra sampling fields: constrained tokens and structured outputs (and the
    # guided_* names older vLLM clients send).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        vocab_size: int,
    ) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ServingError("best_of is not supported: leave it unset or equal to n", "best_of")
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(
                n=self.n,
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                temperature=_or(self.temperature, 1.0),
                top_p=_or(self.top_p, 1.0),
                top_k=_or(self.top_k, 0),
                min_p=_or(self.min_p, 0.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self._logit_bias(vocab_size),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                structured_outputs=self._structured_outputs(),
                output_kind=kind,
            )
        except ValueError as e:
            raise ServingError(str(e), self.field_named_in(str(e))) from None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's `structured_outputs`, or the guided_* fields, or the chat's
        response_format, as one StructuredOutputsParams (ServingError naming the field)."""
        guided = {
            kind: value
            for kind in ("json", "regex", "choice", "grammar")
            if (value := getattr(self, f"guided_{kind}")) is not None
        }
        sources = {
            name: value
            for name, value in [
                ("structured_outputs", self.structured_outputs),
                (f"guided_{next(iter(guided), '')}", guided),
                ("response_format", self._response_format_constraint()),
            ]
            if value
        }
        if not sources:
            return None
        if len(sources) > 1:
            raise ServingError(
                f"give one of {sorted(sources)}, not several", next(iter(sorted(sources)))
            )
        [(field, spec)] = sources.items()
        try:
            return StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:
            raise ServingError(f"{field}: {e}", field) from None

    def _response_format_constraint(self) -> dict[str, Any] | None:
        return None  # the chat request's response_format

    def _logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab_size:
                raise ServingError(
                    f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                    "logit_bias",
                )
            bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
        return bias

    def field_named_in(self, message: str) -> str | None:
        """The request field an error message starts with (SamplingParams' and the engine's
        do), for the error's `param`."""
        match = re.match(r"\w+", message)
        return match.group(0) if match and match.group(0) in type(self).model_fields else None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class CompletionRequest(SamplingRequest):
    # Normalized by the validator to a list of prompts, each a string or token ids.
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return list(value)
            if is_ids(value):
                return [value]
            if all(is_ids(p) for p in value):
                return [list(p) for p in value]
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids, and not empty"
        )

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def to_sampling_params(self, default_max_tokens: int | None, vocab_size: int) -> SamplingParams:
        """OpenAI's completions default to 16 tokens; echo with logprobs asks for the prompt's."""
        if self.suffix:
            raise ServingError("suffix is not supported", "suffix")
        max_tokens = _or(self.max_tokens, default_max_tokens)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, vocab_size)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict:
        """The message as a chat template reads it: text parts joined by newlines."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise ServingError(
                        f"only text content parts are supported, got type {part.type!r}",
                        "messages",
                    )
                if part.text is None:
                    raise ServingError("a text content part needs its text", "messages")
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def _response_format_constraint(self) -> dict[str, Any] | None:
        """OpenAI's response_format: "text", "json_object", or "json_schema" with
        {"json_schema": {"name", "schema", "strict"}}."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ServingError(
                    "response_format json_schema needs {'json_schema': {'schema': ...}}",
                    "response_format",
                )
            return {"json": schema}
        raise ServingError(
            f"response_format type {kind!r} is not supported: 'text', 'json_object' or "
            "'json_schema'",
            "response_format",
        )

    def to_sampling_params(self, default_max_tokens: int | None, vocab_size: int) -> SamplingParams:
        """Without a limit the reply may fill the context, as in vLLM."""
        if self.tools:
            raise ServingError("tools are not supported", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ServingError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = _or(self.top_logprobs, 0) if self.logprobs else None
        if logprobs is not None and logprobs < 0:
            raise ServingError(f"top_logprobs must be non-negative, got {logprobs}", "top_logprobs")
        max_tokens = _or(self.max_completion_tokens, _or(self.max_tokens, default_max_tokens))
        try:
            return self._sampling_params(max_tokens, logprobs, None, vocab_size)
        except ServingError as e:
            if e.param == "logprobs":
                e.param = "top_logprobs"  # the chat request's name for the count
            raise


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# -------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIBaseModel):
    """A stream chunk's message: only what the chunk carries (OpenAI omits the rest)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedjax"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
