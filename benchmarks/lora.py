"""What LoRA rows cost: W1-style throughput with 0, 1 and 4 distinct adapters in the batch,
against the same model with LoRA off, all in one run taking turns, medians of --repeats.

32 chat prompts of 25-200 tokens, 128 greedy tokens each (ignore_eos), prefix caching off.
The adapters are random, rank --rank on every projection (q/k/v/o/gate/up/down), saved as PEFT
directories and read by the engine as a user's would be; "4 adapters" gives the prompts one
of four in turn (max_loras=4: every adapter in a slot at once).

    python benchmarks/lora.py [--repeats 3] [--rank 16] [--model DIR]
        [--smoke (a tiny random model unless --model, a few tokens)]

Writes results/lora.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import make_prompts, save_random_llama  # noqa: E402


def random_adapters(model: str | None, count: int, rank: int, folder: Path) -> list[Path]:
    """`count` random PEFT adapters of `rank` on every projection of the model."""
    from models.loader import load_model_config
    from models.peft import MODULES, LoRAAdapter, module_shapes, save_peft_adapter

    config = load_model_config(model)
    shapes = module_shapes(config)
    paths = []
    for index in range(count):
        rng = np.random.default_rng(index)
        weights = {
            (layer, module): (
                rng.normal(0, 0.02, (rank, shapes[module][0])).astype(np.float32),
                rng.normal(0, 0.02, (shapes[module][1], rank)).astype(np.float32),
            )
            for layer in range(config.num_layers)
            for module in MODULES
        }
        paths.append(save_peft_adapter(folder / f"a{index}", LoRAAdapter(rank, 1.0, weights)))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.smoke else 3)
    num_prompts, new_tokens = (4, 4) if args.smoke else (32, 128)
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM
    from pagedjax.lora.request import LoRARequest
    from pagedjax.sampling_params import SamplingParams

    options = dict(max_model_len=512, enable_prefix_caching=False)
    base = LLM(args.model, **options)
    lora = LLM(args.model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **options)
    folder = Path(tempfile.mkdtemp(prefix="pagedjax-lora-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(path))
        for i, path in enumerate(random_adapters(args.model, 4, args.rank, folder))
    ]
    prompts = make_prompts(base.get_tokenizer(), num_prompts)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    cases = {
        "lora_off": (base, None),
        "0_adapters": (lora, None),
        "1_adapter": (lora, [adapters[0]] * num_prompts),
        "4_adapters": (lora, [adapters[i % 4] for i in range(num_prompts)]),
    }

    def tokens_per_s(llm, loras) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return num_prompts * new_tokens / (time.perf_counter() - start)

    for llm, loras in cases.values():  # compile every shape, read every adapter
        tokens_per_s(llm, loras)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (llm, loras) in cases.items():
            samples[name].append(tokens_per_s(llm, loras))
    result: dict = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "rank": args.rank,
        "repeats": repeats,
    }
    for name, values in samples.items():
        result[f"{name}_output_tokens_per_s"] = float(np.median(values))
    off = result["lora_off_output_tokens_per_s"]
    for name in list(cases)[1:]:
        result[f"{name}_vs_lora_off"] = result[f"{name}_output_tokens_per_s"] / off
    report("lora", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
