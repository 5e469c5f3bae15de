"""Reinforcement learning beside the engine: a policy trained with optax, its rollouts sampled
by pagedjax between updates, the weights handed over in memory.

Each round samples n=8 completions per prompt (`LLM.generate`), scores them with a toy reward
(how often they emit a target token), and takes a policy-gradient step with group-relative
advantages (GRPO's, without the clipping) on the same model as a differentiable function
(`models.training.token_logprobs`). `llm.update_weights` then gives the engine the new weights:
no reload, and, as the last line checks, nothing compiled after the first round.

    python examples/rl_loop.py --small          # a tiny random Llama: seconds
    python examples/rl_loop.py --rounds 20      # SmolLM2-135M-Instruct: minutes on a CPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tiny import add_model_args, model_path

from models.loader import load_model
from models.training import token_logprobs
from pagedjax import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The weather today", "My favourite food", "In the year 3000"]


def rewards(outputs, target: int) -> np.ndarray:
    """[prompts, n]: the share of each completion's tokens that are the target token."""
    return np.array(
        [[c.token_ids.count(target) / len(c.token_ids) for c in o.outputs] for o in outputs]
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=None, help="default: 8 (--small) or 20")
    parser.add_argument("--learning-rate", type=float, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (8 if args.small else 20)
    with model_path(args) as path:
        config, params = load_model(path)  # float32: the trainer's copy of the weights
        llm = LLM(path, params=params, max_model_len=128, seed=0)
        tokenizer = llm.get_tokenizer()
        target = tokenizer.encode("e" if args.small else " yes", add_special_tokens=False)[-1]
        # Every completion has max_tokens tokens, so each batch has one shape: one compilation.
        sampling = SamplingParams(n=8, temperature=1.0, max_tokens=12, ignore_eos=True)
        optimizer = optax.adam(args.learning_rate or (3e-3 if args.small else 1e-5))
        opt_state = optimizer.init(params)
        prompts = [tokenizer.encode(p) for p in PROMPTS]

        @jax.jit
        def train_step(params, opt_state, tokens, mask, advantages):
            def loss(params):
                logprobs = token_logprobs(params, config, tokens)  # [B, T - 1]
                return -jnp.mean(jnp.sum(logprobs * mask, axis=1) * advantages)

            grads = jax.grad(loss)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        history, compilations = [], []
        for step in range(rounds):
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
            )
            reward = rewards(outputs, target)
            # Group-relative advantages: each completion against its prompt's other samples.
            advantages = (reward - reward.mean(1, keepdims=True)) / (
                reward.std(1, keepdims=True) + 1e-6
            )
            width = max(len(p) for p in prompts) + sampling.max_tokens
            tokens, mask = (
                np.zeros((reward.size, width), np.int32),
                np.zeros((reward.size, width - 1)),
            )
            for row, (prompt, completion) in enumerate(
                (o.prompt_token_ids, c.token_ids) for o in outputs for c in o.outputs
            ):
                sequence = list(prompt) + list(completion)
                tokens[row, : len(sequence)] = sequence
                mask[row, len(prompt) - 1 : len(sequence) - 1] = 1  # logprobs of the completion
            params, opt_state = train_step(params, opt_state, tokens, mask, advantages.reshape(-1))
            llm.update_weights(params)  # the engine's next rollouts use the new policy
            history.append(float(reward.mean()))
            compilations.append(llm.llm_engine.stats()["num_compilations"])
            print(f"round {step:2d}  mean reward {history[-1]:.3f}")
        print(
            f"reward {history[0]:.3f} -> {history[-1]:.3f}; engine compilations after the first "
            f"round: {compilations[-1] - compilations[0]}"
        )
        return {"rewards": history, "new_compilations": compilations[-1] - compilations[0]}


if __name__ == "__main__":
    main()
