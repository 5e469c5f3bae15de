"""POST /v1/chat/completions: the conversation under the model's chat template, n choices,
answered whole or as a server-sent event stream (a role delta first, as OpenAI sends)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedjax.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    ResponseMessage,
    ServingError,
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
from pagedjax.llm import chat_prompt_ids
from pagedjax.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The conversation's token ids, ready for the assistant's reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServingError("the model has no chat template: use /v1/completions", "messages")
        conversation = [message.to_template() for message in messages]
        try:
            return chat_prompt_ids(self.tokenizer, conversation)
        except Exception as e:  # a template that rejects the conversation (roles, order)
            raise ServingError(f"the chat template failed: {e}", "messages") from e

    async def create(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or for `stream` the SSE lines to send; raises ServingError."""
        lora = self.check_model(request.model)
        params = request.to_sampling_params(None, self.vocab_size)
        prompt = self.chat_prompt(request.messages)
        request_id = random_id("chatcmpl")
        streams, firsts = await self.start(request, [prompt], params, request_id, lora)
        if request.stream:
            return self._stream(request, request_id, streams, firsts)
        try:
            finals = await final_outputs(streams, firsts)
        except Exception as e:
            raise engine_error(e) from e
        return self._response(request, request_id, finals[0])

    def _logprobs(self, request: ChatCompletionRequest, piece: Piece) -> ChatLogProbs | None:
        if not request.logprobs:
            return None
        completion = piece.completion
        return self.logprobs.chat(
            completion.token_ids,
            completion.logprobs or [],
            piece.previous_token,
            request.top_logprobs or 0,
        )

    def _response(
        self, request: ChatCompletionRequest, request_id: str, output: RequestOutput
    ) -> ChatCompletionResponse:
        tracker = StreamTracker(request.n, self.metrics)
        choices = [
            ChatCompletionChoice(
                index=piece.index,
                message=ResponseMessage(content=piece.completion.text),
                logprobs=self._logprobs(request, piece),
                finish_reason=piece.completion.finish_reason,
                stop_reason=piece.completion.stop_reason,
            )
            for piece in tracker.pieces(0, output)
        ]
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=tracker.usage()
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        streams: list[Stream],
        firsts: list[RequestOutput],
    ) -> AsyncIterator[str]:
        tracker = StreamTracker(request.n, self.metrics)
        outputs = merge(streams, firsts)

        def chunk(choices: list[ChatStreamChoice], usage=None) -> str:
            response = ChatCompletionChunk(
                id=request_id, model=self.model_name, choices=choices, usage=usage
            )
            return sse(response.model_dump_json())

        try:
            for index in range(request.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatStreamChoice(index=index, delta=role)])
            async for _, output in outputs:
                for piece in tracker.pieces(0, output):
                    choice = ChatStreamChoice(
                        index=piece.index,
                        delta=DeltaMessage(content=piece.completion.text),
                        logprobs=self._logprobs(request, piece),
                        finish_reason=piece.completion.finish_reason,
                        stop_reason=piece.completion.stop_reason,
                    )
                    yield chunk([choice])
            if request.include_usage:
                yield chunk([], tracker.usage())
        except Exception as e:  # the engine died mid-stream: say so, then end the stream
            yield sse_error(e)
        finally:
            await outputs.aclose()
            await close_all(streams)
        yield SSE_DONE
