"""Tensor and data parallelism on 8 CPU devices, and two processes joined by jax.distributed.

The engines run in subprocesses (`tests/parallel_cases.py`): JAX's CPU device count is fixed
when it starts. Tiny float32 models; greedy tokens must not change with the split.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_cases import prompts
from tests.test_engine import hf_greedy
from tests.test_lora import PROJECTIONS, merged_model, write_peft_adapter

SCRIPT = Path(__file__).with_name("parallel_cases.py")


def run_cases(*args: str, timeout: float = 600) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def results_of(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-4000:]
    line = next(line for line in out.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.fixture(scope="module")
def cases(tiny_model_dir, tmp_path_factory) -> dict:
    llama, _ = tiny_model_dir("llama")  # 4 query heads, 2 KV heads
    window, _ = tiny_model_dir("gemma3")  # 4 query heads, 1 KV head, sliding layers
    moe, _ = tiny_model_dir("qwen2_moe")  # 6 experts, a shared one, dense layers between
    hf_llama = tiny_model_dir("llama")[1]
    root = tmp_path_factory.mktemp("adapters")
    adapters = [  # attention only, and every projection
        write_peft_adapter(root / "small", hf_llama, ["q_proj", "k_proj", "o_proj"], 4, 8, 1),
        write_peft_adapter(root / "full", hf_llama, list(PROJECTIONS), 8, 16, 2),
    ]
    paths = [str(path) for path in adapters]
    results = results_of(run_cases("engines", str(llama), str(window), str(moe), *paths))
    # transformers' greedy tokens of the LoRA case's rows: the base model, then each adapter
    # merged, in turn.
    models = [hf_llama] + [merged_model(hf_llama, path) for path in adapters]
    results["lora/transformers"] = [
        hf_greedy(models[i % len(models)], prompt, 24) for i, prompt in enumerate(prompts())
    ]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("split", ["2x1", "4x1", "1x2", "2x2"])
@pytest.mark.slow
def test_greedy_tokens_do_not_change_with_the_split(cases, split):
    """T x D against one device: n=2, shared prefixes, preemption, a second run served
    from the prefix cache, and beam search. T=4 has more shards than KV heads (replicated)."""
    one, split_run = cases["llama/1x1"], cases[f"llama/{split}"]
    assert split_run["tokens"] == one["tokens"]
    assert split_run.get("beams", one["beams"]) == one["beams"]
    assert split_run["again"] == one["tokens"]
    assert len(one["tokens"][1]) == 2  # the n=2 request's two sequences
    assert split_run["preemptions"] > 0
    assert split_run["prefix_cache_hit_rate"] > 0.3


@pytest.mark.slow
def test_new_weights_are_split_over_each_replica_without_compiling(cases):
    """update_weights at T=2 x D=2: the same weights give the same tokens (the prefix cache
    reset, the requests recomputed), and no step compiles again."""
    split_run = cases["llama/2x2"]
    assert split_run["after_update"] == cases["llama/1x1"]["tokens"]
    assert split_run["update_compilations"] == 0


@pytest.mark.slow
def test_the_pallas_kernels_run_per_shard(cases):
    first = [tokens[0][:4] for tokens in cases["llama/1x1"]["tokens"][:2]]
    assert cases["layout"]["pallas_tokens"] == first


@pytest.mark.slow
def test_data_parallel_replicas_each_draft_on_their_own_device(cases):
    one, drafted = cases["llama/1x1"], cases["draft/1x2"]
    assert drafted["tokens"] == one["tokens"]
    assert drafted["acceptance_rate"] == 1.0 and min(drafted["replica_drafts"]) > 0
    assert drafted["draft_devices"] == [[0], [1]]


@pytest.mark.slow
def test_async_llm_over_two_replicas(cases):
    assert cases["async/1x2"] == [tokens[0] for tokens in cases["llama/1x1"]["tokens"]]


@pytest.mark.slow
def test_lora_adapters_split_over_four_shards_give_transformers_merged_tokens(cases):
    """Base rows and two adapters' in one batch; 4 shards repeat the 2 KV heads, and the
    adapters' B columns with them."""
    assert cases["lora/4x1"] == cases["lora/transformers"]


@pytest.mark.slow
def test_one_kv_head_is_replicated_on_two_shards(cases):
    """Gemma 3 split in two, its KV cache groups' tables read inside shard_map."""
    assert cases["window/2x1"]["tokens"] == cases["window/1x1"]["tokens"]
    memory = cases["window/2x1"]["memory"]
    # Each shard holds the one KV head: per device as much pool as one device, twice in all.
    assert memory["kv_cache_bytes_total"] == 2 * memory["kv_cache_bytes_per_device"]
    assert (
        memory["kv_cache_bytes_per_device"] == cases["window/1x1"]["memory"]["kv_cache_bytes_total"]
    )


@pytest.mark.slow
def test_data_parallel_replicas_share_the_load_and_keep_prefix_affinity(cases):
    dp = cases["llama/1x2"]
    assert all(tokens > 0 for tokens in dp["replica_prompt_tokens"])
    affinity = dp["affinity"]  # a new prompt with the shared prefix goes where it is cached
    assert affinity["cached"][affinity["chosen"]] == 2
    assert min(affinity["cached"]) == 0
    assert dp["memory"]["num_devices"] == 2


@pytest.mark.slow
def test_every_weight_and_the_pool_are_split(cases):
    """Split weights hold 1/T of their bytes on each device; only the norms are replicated."""
    layout = cases["layout"]
    replicated = {"['final_norm']", "['layers']['attn_norm']", "['layers']['mlp_norm']"}
    for name, (total, shards) in layout["weights"].items():
        assert len(shards) == 2
        expected = total if name in replicated else total // 2
        assert shards == [expected, expected], name
    for name, (total, shards) in layout["pool"].items():
        assert shards == [total // 2, total // 2], name


@pytest.mark.slow
def test_the_compiled_step_holds_the_expected_collectives(cases):
    """Per step: the vocabulary-parallel embedding's all-reduce, the two row-parallel
    all-reduces of the (scanned, so counted once) layer, the logits' all-gather; nothing
    else, for a decode and a mixed bucket."""
    expected = {
        "all-reduce": 3,
        "all-gather": 1,
        "reduce-scatter": 0,
        "collective-permute": 0,
        "all-to-all": 0,
    }
    for tokens, counts in cases["layout"]["collectives"].items():
        assert counts == expected, tokens


@pytest.mark.slow
def test_experts_split_over_devices_give_the_same_tokens(cases):
    """Expert parallelism on the tensor-parallel axis: each of two devices holds 3 of the 6
    experts (and half the shared expert), routes every token and computes its own experts'
    share; one all-reduce completes the MLP as it does a dense one, so the step's collectives
    are the dense model's. Greedy tokens equal one device's, through n=2 and preemption."""
    experts = cases["experts"]
    assert experts["tokens/2"] == experts["tokens/1"]
    assert experts["preemptions/2"] > 0
    for name, (total, shards) in experts["expert_bytes"].items():
        split = name not in ("router", "shared_gate")
        assert shards == [total // 2] * 2 if split else [total] * 2, name
    dense_step = {"all-reduce": 3, "all-gather": 1, "reduce-scatter": 0,
                  "collective-permute": 0, "all-to-all": 0}  # fmt: skip
    for tokens, counts in experts["collectives"].items():
        assert counts == dense_step, tokens
    # The GPU's split layout: each shard's experts through the Pallas kernel (interpreted).
    assert experts["pallas_tokens"] == [t[0][:3] for t in experts["tokens/1"][:2]]


@pytest.mark.slow
def test_the_tensor_parallel_step_lowers_for_cuda_with_the_pallas_kernels(cases):
    if not cases["layout"]["cuda"]:
        pytest.skip("jax >= 0.11 lowers Triton for a GPU it sees (the GPU check)")
    for tokens, lowered in cases["layout"]["cuda"].items():
        assert lowered["triton_calls"] >= 1, tokens
        assert (lowered["all_reduce"], lowered["all_gather"]) == (3, 1), tokens


@pytest.mark.slow
def test_per_device_memory_is_reported(cases):
    one, two = cases["llama/1x1"]["memory"], cases["llama/2x1"]["memory"]
    assert two["num_devices"] == 2
    assert two["kv_cache_bytes_per_device"] * 2 == two["kv_cache_bytes_total"]
    assert two["kv_cache_bytes_total"] == one["kv_cache_bytes_total"]
    assert two["weights_bytes_per_device"] < one["weights_bytes_total"] / 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_jax_distributed_match_one(tiny_model_dir, cases):
    """Two processes (one CPU device each) joined by jax.distributed, the model split over
    both, against one process: the same tokens, returned by both processes, with requests
    preempted by swap (each process copies its own heads out and back)."""
    llama, _ = tiny_model_dir("llama")
    coordinator = f"localhost:{free_port()}"
    processes = [run_cases("process", str(llama), coordinator, "2", str(i)) for i in range(2)]
    single = cases["llama/1x1"]
    leader, follower = (results_of(p, timeout=300) for p in processes)
    assert leader.pop("swapped") > 0
    for result in (leader, follower):
        assert result == {"tokens": single["tokens"], "again": single["tokens"]}


# --- fast checks, in this process (one device) --------------------------------------------


def test_kv_heads_are_replicated_to_the_least_common_multiple():
    from models.tensor_parallel import tensor_parallel_config

    def config(heads, kv_heads, vocab=100):
        from models.config import ModelConfig

        return ModelConfig(
            "LlamaForCausalLM", vocab, 64, 96, 2, heads, kv_heads, 16, 1e-6, 1e4, 128, False
        )

    split, repeat = tensor_parallel_config(config(12, 3), 2)
    assert (split.num_kv_heads, repeat, split.vocab_size) == (6, 2, 100)
    split, repeat = tensor_parallel_config(config(8, 2), 8)
    assert (split.num_kv_heads, repeat) == (8, 4)
    assert tensor_parallel_config(config(8, 2, vocab=101), 4)[0].vocab_size == 104


@pytest.mark.parametrize(
    "heads,kv_heads,size,named",
    [
        (4, 2, 3, "num_attention_heads 4"),
        (9, 3, 2, "num_attention_heads 9"),
        (12, 4, 8, "num_attention_heads 12"),
    ],
)
def test_a_split_that_does_not_divide_says_what(heads, kv_heads, size, named):
    from models.config import ModelConfig
    from models.tensor_parallel import TensorParallelError, tensor_parallel_config

    config = ModelConfig(
        "LlamaForCausalLM", 100, 64, 96, 2, heads, kv_heads, 16, 1e-6, 1e4, 128, False
    )
    with pytest.raises(TensorParallelError, match=named):
        tensor_parallel_config(config, size)


def test_experts_that_do_not_divide_say_so():
    from models.config import ModelConfig, MoeConfig
    from models.tensor_parallel import TensorParallelError, tensor_parallel_config

    moe = MoeConfig(6, 2, 32, False, (True, True), shared_intermediate_size=20)
    config = ModelConfig(
        "Qwen2MoeForCausalLM", 100, 64, 0, 2, 8, 8, 8, 1e-6, 1e4, 128, False, moe=moe
    )
    assert tensor_parallel_config(config, 2)[0].moe == moe  # no dense MLP to divide
    with pytest.raises(TensorParallelError, match="the 6 experts and .*intermediate_size 20"):
        tensor_parallel_config(config, 8)


def test_too_few_devices_is_a_clear_error_before_loading(tiny_model_dir):
    from pagedjax import LLM

    path, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="needs 4 devices.*xla_force_host_platform_device_count"):
        LLM(str(path), tensor_parallel_size=2, data_parallel_size=2)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be positive"),
        (dict(data_parallel_size=0), "data_parallel_size must be positive"),
        (
            dict(tensor_parallel_size=2, kv_cache_dtype="fp8", calculate_kv_scales=True),
            "calibrate with tensor_parallel_size=1",
        ),
    ],
)
def test_parallel_options_are_checked(options, message):
    from pagedjax.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


class _HostOnlyWorker:
    """Enough of a worker for an engine core that is never stepped: routing only."""

    def __init__(self):
        from kernels_pallas.kv_groups import single_group
        from pagedjax.core.memory import KVCacheSpec

        self.num_blocks, self.kv_spec = 64, KVCacheSpec(2, 2, 16, "float32")
        self.num_host_blocks = 0
        self.kv_groups = single_group(2)
        self.steady_decode = False


def _router(slack: int):
    from pagedjax.config import EngineConfig
    from pagedjax.data_parallel import DataParallelCore
    from pagedjax.engine_core import EngineCore

    config = EngineConfig(block_size=16, max_model_len=256, data_parallel_size=2)
    return DataParallelCore([EngineCore(config, _HostOnlyWorker()) for _ in range(2)], slack)


def _request(request_id: str, prompt: list[int]):
    from pagedjax.core.engine_request import EngineRequest
    from pagedjax.sampling_params import SamplingParams

    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=8), max_tokens=8, seed=0)


def test_requests_go_to_the_least_loaded_replica_unless_a_prefix_is_there():
    router = _router(slack=2)
    shared = list(range(3, 3 + 48))  # three full blocks
    router.add_request(_request("a", shared + [1]))
    router.add_request(_request("b", [7] * 40))  # nothing shared: the emptier replica
    assert [router._replica_of[r] for r in "ab"] == [0, 1]
    # The shared prefix is not cached yet, but "a" was sent to replica 0: "c" follows it.
    router.add_request(_request("c", shared + [2]))
    router.add_request(_request("d", shared + [3]))
    assert [router._replica_of[r] for r in "cd"] == [0, 0]
    router.add_request(_request("e", shared + [4]))  # 3 against 1: within the slack of 2
    assert router._replica_of["e"] == 0
    router.add_request(_request("f", shared + [5]))  # 4 against 1: the prefix no longer wins
    assert router._replica_of["f"] == 1
    router.abort_requests(["a", "c", "d"])
    assert [core.num_unfinished_sequences() for core in router.cores] == [1, 2]
    assert set(router._replica_of) == {"b", "e", "f"}
