"""Offline throughput of the engine on a GPU, with transformers' `generate` on the same GPU as
the peer, in one process run.

The model has SmolLM2-135M's shape (30 layers, 576 wide, 9 query and 3 KV heads, 49,152 tokens)
with random bf16 weights, built and saved locally: the default model's GGUF is too large to
carry to the device machine, and its speed does not depend on the weights' values. Every request
has a random prompt of --prompt-len tokens and decodes exactly --tokens (ignore_eos; the peer
with EOS switched off), greedy.

    python benchmarks/gpu_throughput.py [--requests 256] [--prompt-len 128] [--tokens 128]
        [--peer-batch 256] [--out DIR] [--model-dir DIR [--build-only]]
        [--smoke (engine and peer on the CPU: the tiny random Llama, 4 requests x 4 tokens)]

Prints output tokens/s of both and the ratio; writes gpu_throughput.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import add_smoke_flag, results_dir  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama  # noqa: E402


def build_model(path: Path, num_layers: int) -> None:
    """A random Llama of SmolLM2-135M's shape, saved in bf16 with a word-level tokenizer and a
    chat template (host_overhead.py --model runs chat prompts on it)."""
    save_random_llama(
        path, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=num_layers,
        num_heads=9, num_kv_heads=3, dtype="bfloat16",
    )  # fmt: skip


def run_engine(
    path: Path, prompts: list[list[int]], tokens: int, num_kv_blocks: int | None = None
) -> dict:
    """num_kv_blocks None: the engine's own budget (on a CPU, far more than a smoke run needs)."""
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=len(prompts), num_kv_blocks=num_kv_blocks)
    load_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm up the buckets
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    core = llm.llm_engine.engine_core
    seconds = sorted(runs)[1]
    return dict(
        engine_load_s=load_s,
        engine_s=seconds,
        engine_output_tok_per_s=generated / seconds,
        engine_attention=core.worker.attention.name,
        engine_dtype=core.worker.config.dtype,
        engine_kv_dtype=str(core.worker.kv_spec.dtype),
        engine_compilations=core.worker.runner.num_compilations,
        engine_kv_blocks=core.stats()["kv_blocks_total"],
    )


def run_peer(path: Path, prompts: list[list[int]], tokens: int, batch: int) -> dict:
    """transformers generate, bf16 on the GPU (the CPU where torch has no CUDA: a dry run),
    static batches of equal-length prompts."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device).eval()
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                    eos_token_id=None, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        model.generate(torch.tensor(prompts[:2], device=device), **dict(settings, max_new_tokens=4,
                       min_new_tokens=4))  # fmt: skip
        sync()
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=device)
            out = model.generate(ids, **settings)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        sync()
    seconds = time.perf_counter() - start
    return dict(
        peer_device=device,
        peer_s=seconds,
        peer_output_tok_per_s=generated / seconds,
        peer_batch=batch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--peer-batch", type=int, default=256)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results")
    parser.add_argument("--model-dir", type=Path, default=None, help="save (or reuse) it here")
    parser.add_argument("--build-only", action="store_true", help="save the model and stop")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(requests=4, prompt_len=8, tokens=4, layers=1, peer_batch=4)
    args = parser.parse_args()
    args.out = args.out or results_dir(args.smoke)

    import jax
    import numpy as np

    if args.smoke and args.model_dir is None:
        path = save_random_llama()  # cached, and a shape the CPU runs in seconds
    else:
        path = args.model_dir or Path(tempfile.mkdtemp(prefix="gpu_throughput_"))
        if not (path / "config.json").exists():
            build_model(path, args.layers)
    if args.build_only:
        print(f"saved {path}")
        return
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, vocab_size, (args.requests, args.prompt_len)).tolist()
    result = dict(
        device=jax.devices()[0].device_kind, requests=args.requests,
        prompt_len=args.prompt_len, tokens=args.tokens, layers=args.layers,
    )  # fmt: skip
    blocks = kv_blocks(args.requests, 1024) if args.smoke else None
    result.update(run_engine(path, prompts, args.tokens, blocks))
    print(json.dumps(result), flush=True)
    if not args.no_peer:
        result.update(run_peer(path, prompts, args.tokens, args.peer_batch))
        result["engine_over_peer"] = (
            result["engine_output_tok_per_s"] / result["peer_output_tok_per_s"]
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:28s} {value:.3f}" if isinstance(value, float) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
