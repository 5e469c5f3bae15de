"""What completions and chat completions share: the model check, starting the engine's
streams with engine errors turned into HTTP ones, usage, logprobs and SSE framing."""

from __future__ import annotations

from typing import NamedTuple

from pagedjax.entrypoints.openai.logprobs import LogprobsFormatter
from pagedjax.entrypoints.openai.metrics import ServerMetrics
from pagedjax.entrypoints.openai.protocol import (
    PromptTokensDetails,
    SamplingRequest,
    ServingError,
    UsageInfo,
)
from pagedjax.entrypoints.openai.serving_models import ServingModels
from pagedjax.entrypoints.openai.streams import EmptyStreamError, Stream, first_outputs
from pagedjax.errors import EngineDeadError, QueueFullError
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams

SSE_DONE = "data: [DONE]\n\n"


def engine_error(error: Exception) -> ServingError:
    """The HTTP error for an exception the engine raised on a request."""
    if isinstance(error, ServingError):
        return error
    if isinstance(error, QueueFullError):
        return ServingError(str(error), status=503, type="server_error", code="queue_full")
    if isinstance(error, EngineDeadError):
        return ServingError(str(error), status=503, type="server_error", code="engine_dead")
    if isinstance(error, EmptyStreamError):
        return ServingError(str(error), status=500, type="server_error")
    if isinstance(error, ValueError):  # InvalidRequestError, RequestTooLongError
        return ServingError(str(error))
    return ServingError(f"internal error: {error!r}", status=500, type="server_error")


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: Exception) -> str:
    """An error inside a stream whose status line is already sent, as vLLM sends it."""
    return sse(engine_error(error).response().model_dump_json())


class Piece(NamedTuple):
    """What is new in one choice: its index across the request's prompts, its completion
    output, and the token before the new ones (the prompt's last, at first)."""

    index: int
    completion: CompletionOutput
    previous_token: int


class StreamTracker:
    """Follows the outputs of one API request's engine requests (one per prompt, n choices
    each): which choices have news, which finished, the usage so far, and the metrics of each
    engine request as it finishes."""

    def __init__(self, n: int, metrics: ServerMetrics) -> None:
        self.n, self.metrics = n, metrics
        self.finished: set[int] = set()
        self.num_tokens: dict[int, int] = {}  # choice index -> its tokens so far
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.last_token: dict[int, int] = {}  # choice index -> its last token so far

    def pieces(self, prompt_index: int, output: RequestOutput) -> list[Piece]:
        """A piece for each choice with something new in the output (text, tokens or its
        finish), none after its finish."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens or 0
        news = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            if index in self.finished:
                continue
            self.num_tokens[index] = self.num_tokens.get(index, 0) + len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finished.add(index)
            elif not completion.text and not completion.token_ids:
                continue
            previous = self.last_token.get(index, output.prompt_token_ids[-1])
            if completion.token_ids:
                self.last_token[index] = completion.token_ids[-1]
            news.append(Piece(index, completion, previous))
        if output.finished:
            first = prompt_index * self.n
            longest = max(self.num_tokens.get(i, 0) for i in range(first, first + self.n))
            self.metrics.observe_finished(output, longest)
        return news

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.num_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )


class OpenAIServing:
    """Base of the completions and chat handlers: one per app, over one engine."""

    def __init__(self, engine, models: ServingModels, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.models = models
        self.model_name = models.base_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size: int = engine.model_config.vocab_size
        self.logprobs = LogprobsFormatter(self.tokenizer)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for an unknown one."""
        return self.models.lookup(model)

    async def start(
        self,
        request: SamplingRequest,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        lora: LoRARequest | None = None,
    ) -> tuple[list[Stream], list[RequestOutput]]:
        """One engine request per prompt, and each one's first output; an engine refusal is
        raised as a ServingError (naming the request's field at fault) with nothing left
        running."""
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [
            self.engine.generate(prompt, params, rid, request.priority, lora_request=lora)
            for prompt, rid in zip(prompts, ids, strict=True)
        ]
        try:
            return streams, await first_outputs(streams)
        except Exception as e:
            error = engine_error(e)
            if error.status == 400 and error.param is None:
                error.param = request.field_named_in(error.message)
            raise error from e
