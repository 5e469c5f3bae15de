"""POST /v1/completions: one engine request per prompt, n choices each, answered whole or as
a server-sent event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedjax.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagedjax.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    Piece,
    StreamTracker,
    engine_error,
    sse,
    sse_error,
)
from pagedjax.entrypoints.openai.streams import Stream, close_all, final_outputs, merge
from pagedjax.outputs import RequestOutput

# OpenAI's default for completions (chat's is the rest of the context).
DEFAULT_MAX_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """The response, or for `stream` the SSE lines to send; raises ServingError."""
        lora = self.check_model(request.model)
        params = request.to_sampling_params(DEFAULT_MAX_TOKENS, self.vocab_size)
        request_id = random_id("cmpl")
        streams, firsts = await self.start(request, request.prompts, params, request_id, lora)
        if request.stream:
            return self._stream(request, request_id, streams, firsts)
        try:
            finals = await final_outputs(streams, firsts)
        except Exception as e:
            raise engine_error(e) from e
        return self._response(request, request_id, finals)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _choice(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        piece: Piece,
        echo: bool,
        text_offset: int = 0,
        prompt_logprobs: list | None = None,
    ) -> CompletionChoice:
        """One choice (or a stream's piece of one); `echo` puts the prompt first, and its
        logprobs (`prompt_logprobs`, by default the output's) if logprobs are asked for."""
        completion = piece.completion
        text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs
        previous: int | None = piece.previous_token
        if echo:
            text = self._prompt_text(output) + text
            if request.logprobs is not None:
                token_ids = output.prompt_token_ids + token_ids
                prompt_entries = prompt_logprobs or output.prompt_logprobs
                prompt_entries = prompt_entries or [None] * len(output.prompt_token_ids)
                entries = prompt_entries + (entries or [])
                previous = None
        logprobs = None
        if request.logprobs is not None:
            logprobs = self.logprobs.completion(token_ids, entries or [], previous, text_offset)
        return CompletionChoice(
            index=piece.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _response(
        self, request: CompletionRequest, request_id: str, finals: list[RequestOutput]
    ) -> CompletionResponse:
        tracker = StreamTracker(request.n, self.metrics)
        choices = []
        for prompt_index, output in enumerate(finals):
            for piece in tracker.pieces(prompt_index, output):
                choices.append(self._choice(request, output, piece, request.echo))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=tracker.usage()
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        streams: list[Stream],
        firsts: list[RequestOutput],
    ) -> AsyncIterator[str]:
        tracker = StreamTracker(request.n, self.metrics)
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # choice index -> characters sent, for text_offset
        outputs = merge(streams, firsts)
        # One engine request per prompt: DELTA outputs carry the prompt's logprobs once, but
        # each of its n choices echoes them.
        prompt_logprobs: dict[int, list] = {}
        try:
            async for prompt_index, output in outputs:
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for piece in tracker.pieces(prompt_index, output):
                    index = piece.index
                    echo = request.echo and index not in echoed
                    echoed.add(index)
                    choice = self._choice(
                        request,
                        output,
                        piece,
                        echo,
                        offsets.get(index, 0),
                        prompt_logprobs.get(prompt_index),
                    )
                    offsets[index] = offsets.get(index, 0) + len(choice.text)
                    chunk = CompletionResponse(
                        id=request_id, model=self.model_name, choices=[choice]
                    )
                    yield sse(chunk.model_dump_json())
            if request.include_usage:
                chunk = CompletionResponse(
                    id=request_id, model=self.model_name, choices=[], usage=tracker.usage()
                )
                yield sse(chunk.model_dump_json())
        except Exception as e:  # the engine died mid-stream: say so, then end the stream
            yield sse_error(e)
        finally:
            await outputs.aclose()
            await close_all(streams)
        yield SSE_DONE
