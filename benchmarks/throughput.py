"""Offline throughput of the engine on the default model, workload W1: 32 chat-templated prompts
of 25-200 tokens (seeded), greedy, exactly 128 new tokens each (ignore_eos).

    python benchmarks/throughput.py [--prompts 32] [--tokens 128] [--max-num-batched-tokens 512]

Prints output and total tokens/s, warmup time and compile count; writes JSON to results/.
(The transformers peer and workload W2 come with the benchmark suite.)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import report  # noqa: E402  (benchmarks/ is the script directory)

TOPICS = [
    "the history of the printing press",
    "how vaccines work",
    "the rules of chess",
    "why leaves change color",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of honeybees",
    "how compilers work",
    "the causes of tides",
    "the invention of the telephone",
    "how to bake bread",
    "black holes",
]


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts whose token counts are spread over 25-200 by repeating context sentences."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(25, 200)
        topic = rng.choice(TOPICS)
        text = f"Explain {topic} to a curious student."
        while True:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(ids, add_special_tokens=False)
            if len(ids) >= target:
                break
            text += f" Please also mention something surprising about {rng.choice(TOPICS)}."
        prompts.append(ids[-target:] if len(ids) > target else ids)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(
        None,
        max_model_len=512,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=1 + max(args.prompts * (-(-(200 + args.tokens) // 16)), 512 // 16),
    )
    engine = llm.llm_engine
    warmup_s = engine.runner.warmup()
    compiled = engine.runner.num_compilations
    prompts = make_prompts(llm.get_tokenizer(), args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    result = {
        "workload": f"W1: {args.prompts} prompts x {args.tokens} tokens, greedy",
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "warmup_s": warmup_s,
        "compilations_in_warmup": compiled,
        "compilations_after_warmup": engine.runner.num_compilations - compiled,
        "steps": engine.num_steps,
    }
    report("throughput", result)


if __name__ == "__main__":
    main()
