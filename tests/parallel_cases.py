"""The parallel engine's cases, run in a process of its own by tests/test_parallel.py.

JAX fixes its device count when it starts, so the tests cannot make 8 CPU devices in the
pytest process: this script sets XLA_FLAGS before importing JAX, runs the cases and prints
one JSON line of results for the tests to check.

    python tests/parallel_cases.py engines MODEL_DIR WINDOW_MODEL_DIR MOE_MODEL_DIR ADAPTER...
    python tests/parallel_cases.py process MODEL_DIR COORDINATOR NUM_PROCESSES PROCESS_ID
"""

from __future__ import annotations

import json
import os
import sys

MODES = ("engines", "process")

if __name__ == "__main__" and sys.argv[1] == "engines":
    flags = os.environ.get("XLA_FLAGS", "")  # the test run's own (tests/conftest.py)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK = 16
SMALL_POOL = dict(num_kv_blocks=14, block_size=BLOCK, max_model_len=128, max_num_batched_tokens=64)


def prompts() -> list[list[int]]:
    """Four prompts sharing a 40-token prefix (two full blocks), and four of their own."""
    shared = [(7 * i) % 120 + 3 for i in range(40)]
    tails = [[(11 * i + j) % 120 + 3 for j in range(5 + i)] for i in range(4)]
    own = [[(13 * i + 5 * j) % 120 + 3 for j in range(9 + 6 * i)] for i in range(4)]
    return [shared + t for t in tails] + own


def generate(llm, params_list) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts(), params_list, False)]


def case_params() -> list:
    """Greedy, 24 tokens each; the second prompt asks for n=2."""
    from pagedjax import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    pair = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    return [pair if i == 1 else greedy for i in range(len(prompts()))]


def engine_case(model_dir: str, tp: int, dp: int, **options) -> dict:
    from pagedjax import LLM
    from pagedjax.beam_search import BeamSearchParams

    options = {**SMALL_POOL, **options}
    llm = LLM(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, **options)
    first = generate(llm, case_params())
    again = generate(llm, case_params())  # the prefix cache holds every prompt now
    stats = llm.llm_engine.stats()
    result = {
        "tokens": first,
        "again": again,
        "preemptions": stats["num_preemptions"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "memory": {k: v for k, v in stats.items() if "bytes" in k or k == "num_devices"},
    }
    if tp == dp:  # one device, and forks in each replica of a split group
        beam_params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
        beams = llm.beam_search(prompts()[3:6], beam_params)
        result["beams"] = [[beam.tokens for beam in output.sequences] for output in beams]
    if tp > 1 and dp > 1:  # new weights split over each replica's group, nothing compiled
        from models.loader import load_model

        compilations = llm.llm_engine.stats()["num_compilations"]
        llm.update_weights(load_model(model_dir)[1])
        result["after_update"] = generate(llm, case_params())
        result["update_compilations"] = llm.llm_engine.stats()["num_compilations"] - compilations
    if dp > 1:
        core = llm.llm_engine.engine_core
        result["replica_prompt_tokens"] = [s["num_prompt_tokens"] for s in stats["replicas"]]
        request, _ = llm.llm_engine.process_request("probe", prompts()[0][:40] + [9, 9, 9])
        chosen = core.choose_replica(request)
        hashes = core._prompt_hashes(request)
        result["affinity"] = {
            "chosen": chosen,
            "cached": [c.kv_cache_manager.num_cached_prefix_blocks(hashes) for c in core.cores],
        }
    return result


def layout_case(model_dir: str, tp: int) -> dict:
    """Per-device bytes of every weight and of the pool, the compiled step's collectives,
    and the step lowered for CUDA with the Pallas kernels inside shard_map."""
    import jax

    from models.tensor_parallel import count_collectives
    from pagedjax import LLM

    llm = LLM(model_dir, tensor_parallel_size=tp, attention_backend="pallas", **SMALL_POOL)
    worker = llm.llm_engine.workers[0]
    # Traced for the GPU: the kernels compiled (not interpreted) under the lowering. jax 0.11
    # lowers Triton only for a GPU it sees or an abstract mesh, which a concrete CPU mesh's
    # shard_map refuses: there the lowering is left to the GPU check.
    os.environ["PAGEDJAX_PALLAS_INTERPRET"] = "0"
    from benchmarks.triton_compile import triton_call_targets

    cuda = {}
    for tokens in (1, 64) if jax.__version_info__ < (0, 11) else ():
        lowered = worker.runner.lower_step(tokens, lowering_platforms=("cuda",))
        text = lowered.as_text()
        cuda[tokens] = {
            "triton_calls": len(triton_call_targets(lowered)),
            "all_reduce": text.count("stablehlo.all_reduce"),
            "all_gather": text.count("stablehlo.all_gather"),
        }
    os.environ["PAGEDJAX_PALLAS_INTERPRET"] = "1"
    weights = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(worker.params):
        name = jax.tree_util.keystr(path)
        weights[name] = [leaf.nbytes, [s.data.nbytes for s in leaf.addressable_shards]]
    pool = {
        name: [leaf.nbytes, [s.data.nbytes for s in leaf.addressable_shards]]
        for name, leaf in (("k", worker.runner.kv_cache.k), ("v", worker.runner.kv_cache.v))
    }
    # The kernels run per shard (interpreted here): the first tokens of two prompts.
    from pagedjax import SamplingParams

    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    pallas_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts()[:2], short, False)]
    xla = LLM(model_dir, tensor_parallel_size=tp, attention_backend="xla", **SMALL_POOL)
    runner = xla.llm_engine.workers[0].runner
    collectives = {
        tokens: count_collectives(runner.lower_step(tokens).compile().as_text())
        for tokens in (1, 64)
    }
    return {
        "weights": weights,
        "pool": pool,
        "collectives": collectives,
        "cuda": cuda,
        "pallas_tokens": pallas_tokens,
    }


def draft_case(model_dir: str) -> dict:
    """Two data-parallel replicas, each drafting with the target itself on its own device."""
    from pagedjax import LLM

    spec = {"model": model_dir, "num_speculative_tokens": 3}
    llm = LLM(model_dir, data_parallel_size=2, speculative_config=spec, **SMALL_POOL)
    tokens = generate(llm, case_params())
    stats = llm.llm_engine.stats()
    return {
        "tokens": tokens,
        "acceptance_rate": stats["spec_decode_acceptance_rate"],
        "replica_drafts": [s["spec_decode_num_drafts"] for s in stats["replicas"]],
        "draft_devices": [
            sorted(d.id for d in jax_devices(w.draft.params)) for w in llm.llm_engine.workers
        ],
    }


def expert_parallel_case(model_dir: str) -> dict:
    """A mixture of experts (Qwen2-MoE: expert layers between dense ones, a shared expert) on
    one device and split over two (experts whole, E / 2 a device): greedy tokens with n=2,
    preemption and prefix hits; each device's bytes of the expert weights; the collectives."""
    from models.moe import MOE_WEIGHTS
    from models.tensor_parallel import count_collectives
    from pagedjax import LLM

    result = {}
    for tp in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=tp, **SMALL_POOL)
        stats_before = llm.llm_engine.stats()["num_preemptions"]
        result[f"tokens/{tp}"] = generate(llm, case_params())
        result[f"preemptions/{tp}"] = llm.llm_engine.stats()["num_preemptions"] - stats_before
    worker = llm.llm_engine.workers[0]
    layers = worker.params["layers"]
    result["expert_bytes"] = {
        name: [layers[name].nbytes, [s.data.nbytes for s in layers[name].addressable_shards]]
        for name in MOE_WEIGHTS
        if name in layers
    }
    result["collectives"] = {
        tokens: count_collectives(worker.runner.lower_step(tokens).compile().as_text())
        for tokens in (1, 64)
    }
    # The GPU's layout (`GpuPlatform.prepare_split_params`): the experts wrapped for the
    # Pallas kernel (interpreted here), each shard running its own; two prompts' first tokens.
    from kernels_pallas.grouped_matmul import PallasExperts
    from pagedjax import SamplingParams

    layers = dict(worker.params["layers"])
    for name in ("experts_gate_up", "experts_down"):
        layers[name] = PallasExperts(layers[name], interpret=True)
    worker.params = worker.runner.params = {**worker.params, "layers": layers}
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts()[:2], short, use_tqdm=False)
    result["pallas_tokens"] = [o.outputs[0].token_ids for o in outputs]
    return result


def jax_devices(tree) -> set:
    import jax

    return {d for leaf in jax.tree.leaves(tree) for d in leaf.devices()}


def lora_case(model_dir: str, adapters: list[str], tp: int) -> list[list[int]]:
    """Greedy tokens of a batch mixing base rows and each adapter's in turn (their A and B
    split as their weights are), at tensor parallelism tp."""
    from pagedjax import LLM
    from pagedjax.lora.request import LoRARequest

    llm = LLM(model_dir, tensor_parallel_size=tp, enable_lora=True, max_loras=2,
              max_lora_rank=8, **SMALL_POOL)  # fmt: skip
    loras = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    chosen = [loras[i % len(loras)] for i in range(len(prompts()))]
    greedy = case_params()[0]
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outputs = llm.generate(batch, greedy, use_tqdm=False, lora_request=chosen)
    return [o.outputs[0].token_ids for o in outputs]


def async_case(model_dir: str) -> list[list[int]]:
    """AsyncLLM over two data-parallel replicas: concurrent requests, greedy tokens."""
    import asyncio

    from pagedjax import SamplingParams
    from pagedjax.async_llm import AsyncLLM

    engine = AsyncLLM(model_dir, data_parallel_size=2, **SMALL_POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def one(index: int, prompt: list[int]) -> list[int]:
        async for output in engine.generate(prompt, greedy, request_id=str(index)):
            final = output
        return final.outputs[0].token_ids

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def main() -> None:
    mode = sys.argv[1]
    if mode == "engines":
        model_dir, window_dir, moe_dir, *adapters = sys.argv[2:]
        results = {
            f"llama/{tp}x{dp}": engine_case(model_dir, tp, dp)
            for tp, dp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))
        }
        # Gemma 3: one KV head, replicated on both shards; KV cache groups (a table each
        # for its sliding and full layers) with the bytes of 14 three-layer blocks.
        for tp in (1, 2):
            results[f"window/{tp}x1"] = engine_case(window_dir, tp, 1, num_kv_blocks=42)
        results["layout"] = layout_case(model_dir, 2)
        results["async/1x2"] = async_case(model_dir)
        results["draft/1x2"] = draft_case(model_dir)
        results["experts"] = expert_parallel_case(moe_dir)
        # 4 shards: the 2 KV heads repeated, as the adapters' B columns are.
        results["lora/4x1"] = lora_case(model_dir, adapters, 4)
    else:
        from pagedjax import LLM

        model_dir, coordinator, num_processes, process_id = sys.argv[2:6]
        # Preemption by swap: each process copies its own shards' blocks out and back.
        options = dict(SMALL_POOL, preemption_mode="swap")
        if int(num_processes) > 1:
            options.update(
                coordinator_address=coordinator,
                num_processes=int(num_processes),
                process_id=int(process_id),
                tensor_parallel_size=int(num_processes),
            )
        llm = LLM(model_dir, **options)
        results = {"tokens": generate(llm, case_params()), "again": generate(llm, case_params())}
        if int(process_id) == 0:  # the leader schedules: its counts
            results["swapped"] = llm.llm_engine.stats()["num_swapped_preemptions"]
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
