"""Offline throughput of the engine on the default model, with transformers' static batching as
the peer.

W1: 32 chat-templated prompts of 25-200 tokens (seeded), greedy, exactly --tokens new tokens each.
W2: 256 requests (seeded), prompts of 32-512 tokens, max_tokens 16-512 each with ignore_eos, greedy;
--requests takes the first N (default 8 so that it fits a 2-core machine).

    python benchmarks/throughput.py [--workload W1|W2] [--requests N] [--tokens 128]
        [--max-num-batched-tokens 512] [--max-num-seqs 128] [--block-size N]
        [--num-scheduler-steps K]
        [--int8-activations] [--peer] [--peer-batches 1,8,32] [--peer-requests N]
        [--llamacpp] [--llamacpp-batches 1,8] [--model PATH]
        [--smoke (2 requests x 4 tokens on a tiny random Llama, few step shapes, the peer too)]

--peer runs transformers `generate` (torch CPU float32, 2 threads) on the same token ids in static
batches (left padding, greedy, every batch runs to its longest request's max_tokens); a peer
request counts only its own max_tokens as output. --peer-requests runs the peer on the first N
requests only. --llamacpp runs llama.cpp on the same ids and the same GGUF file in static
batches (`llamacpp_peer.py`; needs llama-cpp-python), with as many threads as the machine's
cores. Prints output and total tokens/s, warmup time and compile count; writes JSON to
results/throughput.json (results/throughput_w2.json for W2).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, load_peer, make_prompts, save_random_llama, w2  # noqa: E402


def run_peer(
    prompts: list[list[int]],
    max_tokens: list[int],
    batches: list[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    model_path: str | None = None,
) -> dict:
    """transformers generate in static batches of each size; output tok/s per batch size."""
    import torch

    torch.set_num_threads(2)
    start = time.perf_counter()
    model = load_peer(model_path)
    result = {"peer_load_s": time.perf_counter() - start}
    pad = 2  # SmolLM2's <|im_end|>; masked by the attention mask
    with torch.no_grad():  # warm up the first-call paths
        model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=pad
        )
    sampling = dict(do_sample=False)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    best = 0.0
    for batch in batches:
        useful, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk, budgets = prompts[i : i + batch], max_tokens[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            new = max(budgets)
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=pad,
                    **sampling,
                )
            useful += sum(budgets)
        tok_s = useful / (time.perf_counter() - start)
        result[f"peer_batch_{batch}_output_tokens_per_s"] = tok_s
        best = max(best, tok_s)
    result["peer_best_output_tokens_per_s"] = best
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["W1", "W2"], default="W1")
    parser.add_argument(
        "--requests",
        "--prompts",
        type=int,
        default=None,
        help="requests to run (default: 32 for W1, 8 of the 256 for W2)",
    )
    parser.add_argument("--tokens", type=int, default=128, help="W1: new tokens per request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--max-num-seqs", type=int, default=128, help="running requests at once (engine default)"
    )
    parser.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=1, help="decode steps per dispatch"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--peer", action="store_true", help="also run transformers generate")
    parser.add_argument("--peer-batches", default="1,8,32", help="static batch sizes of the peer")
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="run the peer on the first N requests only (default: all)",
    )
    parser.add_argument("--llamacpp", action="store_true", help="also run llama.cpp (a GGUF)")
    parser.add_argument("--llamacpp-batches", default="1,8", help="llama.cpp's batch sizes")
    parser.add_argument(
        "--int8-activations", action="store_true", help="the engine's int8_activations option"
    )
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(
            requests=2,
            tokens=4,
            max_num_batched_tokens=64,
            max_num_seqs=2,
            peer=True,
            peer_batches="2",
        )
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())
    return args


def main() -> None:
    args = parse_args()

    from pagedjax.cpu_native.build import isa
    from pagedjax.llm import LLM
    from pagedjax.platforms import current_platform
    from pagedjax.sampling_params import SamplingParams

    w1 = args.workload == "W1"
    count = args.requests or (32 if w1 else 8)
    max_model_len = 512 if w1 else 1024
    longest = 200 + args.tokens if w1 else 1024  # prompt + output tokens of one request
    bs = args.block_size or current_platform().default_block_size
    llm = LLM(
        args.model,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=max(kv_blocks(count, longest, bs), kv_blocks(1, max_model_len, bs)),
        block_size=bs,
        num_scheduler_steps=args.num_scheduler_steps,
        int8_activations=args.int8_activations,
    )
    if w1:
        prompts = make_prompts(llm.get_tokenizer(), count)
        max_tokens = [args.tokens] * count
        label = f"W1: {count} prompts x {args.tokens} tokens"
    else:
        prompts, max_tokens = w2(llm.get_tokenizer(), 256)
        prompts, max_tokens = prompts[:count], max_tokens[:count]
        label = f"W2: {count} of 256 requests, prompts 32-512, outputs 16-512"
    sampled = args.temperature > 0
    label += f", temperature {args.temperature} top-p {args.top_p}" if sampled else ", greedy"
    engine = llm.llm_engine
    warmup_s = engine.engine_core.worker.runner.warmup()
    compiled = engine.engine_core.worker.runner.num_compilations
    params = [
        SamplingParams(
            temperature=args.temperature, top_p=args.top_p, seed=i, max_tokens=m, ignore_eos=True
        )
        for i, m in enumerate(max_tokens)
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    result = {
        "workload": label,
        "cpu_isa": isa(),
        "int8_activations": args.int8_activations,
        "num_scheduler_steps": args.num_scheduler_steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "warmup_s": warmup_s,
        "compilations_in_warmup": compiled,
        "compilations_after_warmup": engine.engine_core.worker.runner.num_compilations - compiled,
        "steps": engine.engine_core.num_steps,
        "preemptions": engine.engine_core.scheduler.num_preemptions,
    }
    if args.peer:
        n = args.peer_requests or count
        batches = [int(b) for b in args.peer_batches.split(",")]
        result["peer_requests"] = n
        peer = run_peer(
            prompts[:n], max_tokens[:n], batches, args.temperature, args.top_p, args.model
        )
        result.update(peer)
        result["engine_vs_best_peer"] = (
            result["output_tokens_per_s"] / result["peer_best_output_tokens_per_s"]
        )
    if args.llamacpp:
        from llamacpp_peer import run_llamacpp

        from models.loader import resolve_model_path

        batches = [int(b) for b in args.llamacpp_batches.split(",")]
        path = str(resolve_model_path(args.model).path)
        result.update(run_llamacpp(path, prompts, max_tokens, batches, os.cpu_count() or 1))
        result["engine_vs_llamacpp"] = (
            result["output_tokens_per_s"] / result["llamacpp_best_output_tokens_per_s"]
        )
    name = ("throughput" if w1 else "throughput_w2") + ("_sampled" if sampled else "")
    report(name, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
