"""LLM: the offline generate API, as in vLLM."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np

from models.llama import Params
from models.loader import load_model_config
from models.peft import adapter_from_arrays
from models.training import DenseKernels
from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedjax.config import EngineConfig
from pagedjax.engine import LLMEngine
from pagedjax.errors import InvalidRequestError
from pagedjax.inputs import PromptType, parse_prompts
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.weight_sync import as_params, model_config_of, named_weights


def chat_prompt_ids(
    tokenizer,
    conversation: list[dict],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """The token ids of a conversation under the model's chat template (or `chat_template`),
    ready for the assistant's reply; with `continue_final_message`, the last (assistant)
    message is left open for the model to continue, as in vLLM and transformers."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be True: continue "
            "the last message, or start a new one"
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except ValueError as e:  # no template, or the conversation does not fit it
        raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)


class LLM:
    """`LLM(model=None, **engine_options)`: None means the default SmolLM2-135M-Instruct.

    In memory (`pagedjax/weight_sync.py`): `LLM(model, params=..., tokenizer=...)` runs the
    given weights (pagedjax's layout or an HF state dict), with `model` a ModelConfig, a
    transformers config or a path to read the config from, and `tokenizer` a tokenizer or a
    path (needed when `model` is not a path).

    `core_process=True`: the engine core (scheduler, model, KV pool) runs in a process of its
    own, as `pagedjax serve` runs it, while this one detokenizes and builds the outputs; the
    weights then come from `model`, a path (`engine_core_client.py`)."""

    def __init__(
        self,
        model: str | object | None = None,
        *,
        params: Params | Mapping[str, object] | None = None,
        tokenizer: str | object | None = None,
        core_process: bool = False,
        **engine_options,
    ):
        in_memory = model is not None and not isinstance(model, (str, os.PathLike))
        path = None if in_memory else model
        tokenizer_object = None
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            tokenizer_object = tokenizer
        elif tokenizer is not None:
            engine_options["tokenizer"] = str(tokenizer)
        if in_memory and tokenizer is None:
            raise InvalidRequestError(
                "a model given as a config has no tokenizer files: pass tokenizer= (a "
                "tokenizer object or a directory)"
            )
        if in_memory and params is None:
            raise InvalidRequestError("a model given as a config needs its weights: pass params=")
        config = EngineConfig.from_options(None if path is None else str(path), **engine_options)
        model_config = None
        if params is not None:
            model_config = model_config_of(model) if in_memory else load_model_config(path)
            params = as_params(model_config, params)
        self.llm_engine = LLMEngine(
            config, model_config, params, tokenizer_object, core_process=core_process
        )
        self._counter = 0

    # ------------------------------------------------------------ weights in and out

    def update_weights(self, params: Params | Mapping[str, object]) -> None:
        """New weights (pagedjax's layout or an HF state dict) between calls, without a
        reload or a recompilation; see `pagedjax/weight_sync.py`."""
        self.llm_engine.update_weights(params)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """vLLM's form: (Hugging Face name, array) pairs covering the whole model."""
        model_config = self.llm_engine.model_config
        self.llm_engine.update_weights(named_weights(model_config, weights))

    def sleep(self, level: int = 1) -> None:
        """Gives the device memory back (the KV pool; the weights, kept on the host at level 1
        and discarded at level 2) until `wake_up()`; only between calls."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what `sleep` freed: "weights" and/or "kv_cache" (both by default)."""
        self.llm_engine.wake_up(tags)

    def dense_kernels(self) -> DenseKernels:
        """For `models.training.token_logprobs(params, config, ids, kernels)`: the kernels
        that give this (batch_invariant=True) engine's logprobs bit for bit, with gradients."""
        return self.llm_engine.dense_kernels()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams (vLLM's defaults)."""
        return SamplingParams()

    def add_lora(
        self, name: str, arrays: Mapping[str, Mapping[str, object]], scale: float = 1.0
    ) -> LoRARequest:
        """A LoRA adapter from memory, as a training loop holds it: module name (q_proj,
        k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) -> {"lora_A": [L, r, K],
        "lora_B": [L, N, r]}, applied as W + scale * A^T B^T. Returns the request to generate
        with; the same name again replaces the weights in place (nothing recompiles; blocks
        cached under the old weights are not reused). Needs enable_lora."""
        adapter = adapter_from_arrays(
            {m: {k: np.asarray(v) for k, v in pair.items()} for m, pair in arrays.items()}, scale
        )
        engine = self.llm_engine
        known = next((r for r in engine.loras.values() if r.lora_name == name), None)
        request = known or LoRARequest(name, max(engine.loras, default=0) + 1)
        engine.add_lora(request, adapter)
        return request

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (its blocks stay free for reuse); returns False,
        and changes nothing, while requests are running, as in vLLM."""
        return self.llm_engine.reset_prefix_cache()

    def _add(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence | None,
        output_kind: RequestOutputKind | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[str]:
        parsed = parse_prompts(prompts)
        loras = lora_request if isinstance(lora_request, list | tuple) else None
        if loras is not None and len(loras) != len(parsed):
            raise ValueError(
                f"got {len(loras)} LoRA requests for {len(parsed)} prompts: give one, or one "
                "per prompt"
            )
        loras = loras or [lora_request] * len(parsed)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(parsed)
        params = list(params)
        if len(params) != len(parsed):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(parsed)} prompts: give one, or one "
                "per prompt"
            )
        priority = [0] * len(parsed) if priority is None else list(priority)
        if len(priority) != len(parsed):
            raise ValueError(
                f"got {len(priority)} priorities for {len(parsed)} prompts: give one per prompt"
            )
        if output_kind is not None:  # one copy per distinct params object, not per prompt
            copies = {id(p): replace(p, output_kind=output_kind) for p in params}
            params = [copies[id(p)] for p in params]
        ids = []
        try:
            for prompt, p, rank, lora in zip(parsed, params, priority, loras, strict=True):
                request_id = str(self._counter)
                self.llm_engine.add_request(request_id, prompt, p, priority=rank, lora_request=lora)
                self._counter += 1
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # nothing half-added stays behind
            raise
        return ids

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; outputs come back in input order.

        `prompts`: a string, token ids, a `TextPrompt` / `TokensPrompt` dict
        (`pagedjax.inputs`), or a list of those; `sampling_params`: one for all or one per
        prompt; `priority`: one per prompt (lower runs first under the "priority" policy).

        As in vLLM, the requests ask for their final output only (`RequestOutputKind.FINAL_ONLY`):
        the engine builds no output for a request that is still running.

        Over several processes (`pagedjax/distributed.py`) every process calls this with the
        same arguments: process 0 runs the engine, the others its device calls, and all
        return process 0's outputs."""
        if not self.llm_engine.is_leader:
            return self.llm_engine.follow() or []
        ids = self._add(
            prompts, sampling_params, RequestOutputKind.FINAL_ONLY, priority, lora_request
        )
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            generated = 0
            while len(finished) < len(ids):
                for output in self.llm_engine.step():
                    # Requests added to the engine directly are not this call's to return.
                    if output.finished and output.request_id in wanted:
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
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields each request's output whenever it has new tokens; `deltas` holds new text.
        Over several processes, only process 0 yields outputs."""
        if not self.llm_engine.is_leader:
            self.llm_engine.follow()
            return
        ids = self._add(prompts, sampling_params, priority=priority)
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

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`pagedjax/beam_search.py`): the best `params.beam_width`
        sequences of each prompt, best first. `concurrency_limit`: prompts searched at once
        (None: as many as the engine's sequence slots hold)."""
        return beam_search(self.llm_engine, prompts, params, use_tqdm, concurrency_limit)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to a conversation (a list of {"role", "content"}
        messages) or to each of a batch of them, under the model's chat template or
        `chat_template`; `chat_template_kwargs` go to the template (vLLM's arguments)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            chat_prompt_ids(
                tokenizer,
                list(c),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
