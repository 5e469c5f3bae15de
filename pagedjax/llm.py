"""LLM: the offline generate API, as in vLLM."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from pagedjax.config import EngineConfig
from pagedjax.engine import LLMEngine
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


def chat_prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The token ids of a conversation under the model's chat template, ready for the
    assistant's reply."""
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class LLM:
    """`LLM(model=None, **engine_options)`: None means the default SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_options):
        self.llm_engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence | None,
        output_kind: RequestOutputKind | None = None,
    ) -> list[str]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts: give one, or one "
                "per prompt"
            )
        if output_kind is not None:  # one copy per distinct params object, not per prompt
            copies = {id(p): replace(p, output_kind=output_kind) for p in params}
            params = [copies[id(p)] for p in params]
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(self._counter)
                self.llm_engine.add_request(request_id, prompt, p)
                self._counter += 1
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # nothing half-added stays behind
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; outputs come back in input order.

        As in vLLM, the requests ask for their final output only (`RequestOutputKind.FINAL_ONLY`):
        the engine builds no output for a request that is still running.

        Over several processes (`pagedjax/distributed.py`) every process calls this with the
        same arguments: process 0 runs the engine, the others its device calls, and all
        return process 0's outputs."""
        if not self.llm_engine.is_leader:
            return self.llm_engine.follow() or []
        ids = self._add(prompts, sampling_params, RequestOutputKind.FINAL_ONLY)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            generated = 0
            while len(finished) < len(ids):
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    generated = self.llm_engine.num_generated_tokens
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            # KeyboardInterrupt or an error: leave the engine clean for the next call.
            self.llm_engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [finished[i] for i in ids]
        self.llm_engine.end_call(outputs)
        return outputs

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields each request's output whenever it has new tokens; `deltas` holds new text.
        Over several processes, only process 0 yields outputs."""
        if not self.llm_engine.is_leader:
            self.llm_engine.follow()
            return
        ids = self._add(prompts, sampling_params)
        pending = set(ids)
        try:
            while pending:
                for output in self.llm_engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            if pending:
                self.llm_engine.abort_request(list(pending))
            self.llm_engine.end_call()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt_ids(self.get_tokenizer(), c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
