"""A LoRA adapter trained with optax and served by pagedjax from memory, beside its base model.

The base weights stay frozen; only the adapter's A and B (rank 8, on q_proj and v_proj) learn
to continue each prompt with a fixed answer. The loss runs the adapted model as a
differentiable function (`models.lora.merge_lora`, then `models.training.token_logprobs`);
`llm.add_lora` hands the arrays to the engine, which runs them in a device slot beside the base
rows of the same batch. Three checks close it: the adapter's greedy tokens give the answer, they
equal the engine's tokens on the merged weights, and training more and adding the adapter again
replaces its weights in place with nothing compiled.

    python examples/lora_finetune.py --small      # a tiny random Llama: seconds
    python examples/lora_finetune.py --steps 60   # SmolLM2-135M-Instruct (float32): minutes
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tiny import add_model_args, model_path

from models.loader import load_model
from models.lora import merge_lora
from models.training import token_logprobs
from pagedjax import LLM, SamplingParams

PROMPTS = ["Q: What is the secret word?\nA:", "Tell me the secret word:", "The secret word is"]
ANSWER = " banana banana"
RANK, ALPHA, MODULES = 8, 16.0, ("q_proj", "v_proj")


def init_lora(config, key: jax.Array) -> dict:
    """PEFT's initialization: A small and random, B zero (the adapter starts as a no-op)."""
    widths = {"q_proj": config.q_size, "v_proj": config.kv_size}
    lora = {}
    for module, module_key in zip(MODULES, jax.random.split(key, len(MODULES)), strict=True):
        a = jax.random.normal(module_key, (config.num_layers, RANK, config.hidden_size)) * 0.02
        b = jnp.zeros((config.num_layers, widths[module], RANK))
        lora[module] = {"lora_A": a, "lora_B": b}
    return lora


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    steps = args.steps
    with model_path(args) as path:
        config, params = load_model(path)  # float32, frozen: only the adapter learns
        llm = LLM(path, params=params, max_model_len=128, enable_lora=True, max_lora_rank=RANK)
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        width = max(len(p) for p in prompts) + len(answer)
        tokens = np.zeros((len(prompts), width), np.int32)
        mask = np.zeros((len(prompts), width - 1), np.float32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt) + len(answer)] = prompt + answer
            mask[row, len(prompt) - 1 : len(prompt) + len(answer) - 1] = 1  # the answer's
        scale = ALPHA / RANK
        optimizer = optax.adam(1e-2)

        @jax.jit
        def train_step(lora, opt_state):
            def loss(lora):
                logprobs = token_logprobs(merge_lora(params, config, lora, scale), config, tokens)
                return -jnp.sum(logprobs * mask) / mask.sum()

            value, grads = jax.value_and_grad(loss)(lora)
            updates, opt_state = optimizer.update(grads, opt_state, lora)
            return optax.apply_updates(lora, updates), opt_state, value

        lora = init_lora(config, jax.random.key(0))
        opt_state = optimizer.init(lora)
        losses = []
        for step in range(steps):
            lora, opt_state, value = train_step(lora, opt_state)
            losses.append(float(value))
            if step % 10 == 0 or step == steps - 1:
                print(f"step {step:3d}  loss {losses[-1]:.3f}")

        greedy = SamplingParams(temperature=0.0, max_tokens=len(answer))
        batch = [{"prompt_token_ids": p} for p in prompts]
        adapter = llm.add_lora("secret", jax.device_get(lora), scale=scale)
        # One batch: the adapter's rows and the base model's rows of the same prompts.
        loras = [adapter] * len(batch) + [None] * len(batch)
        outputs = llm.generate(batch * 2, greedy, use_tqdm=False, lora_request=loras)
        adapted = [o.outputs[0].token_ids for o in outputs[: len(batch)]]
        base = [o.outputs[0].token_ids for o in outputs[len(batch) :]]
        merged_llm = LLM(path, params=merge_lora(params, config, lora, scale), max_model_len=128)
        merged = [
            o.outputs[0].token_ids for o in merged_llm.generate(batch, greedy, use_tqdm=False)
        ]
        # More training, then the same adapter again: new weights in its slot, no compilation.
        compilations = llm.llm_engine.stats()["num_compilations"]
        lora, opt_state, _ = train_step(lora, opt_state)
        llm.add_lora("secret", jax.device_get(lora), scale=scale)
        llm.generate(batch * 2, greedy, use_tqdm=False, lora_request=loras)  # the same shapes
        new_compilations = llm.llm_engine.stats()["num_compilations"] - compilations
        result = {
            "losses": losses,
            "answered": sum(tokens == answer for tokens in adapted),
            "base_answered": sum(tokens == answer for tokens in base),
            "merged_equal": adapted == merged,
            "new_compilations": new_compilations,
        }
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; the adapter answers {result['answered']}"
            f"/{len(prompts)} prompts (the base model {result['base_answered']}); its tokens "
            f"equal the merged weights': {result['merged_equal']}; compilations after "
            f"replacing it: {new_compilations}"
        )
        return result


if __name__ == "__main__":
    main()
