"""Right by default on a GPU, checked on the CPU with the GPU's facts injected: dtype "auto",
the Pallas-to-XLA fallback at start-up, and the KV budget from the card's memory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pagedjax.engine
import pagedjax.platforms
from kernels_pallas.backend import FunctionBackend
from models.loader import checkpoint_dtype
from pagedjax.config import EngineConfig
from pagedjax.engine import LLMEngine
from pagedjax.platforms import DEFAULT_KV_BYTES
from pagedjax.platforms.cpu import cpu_platform
from pagedjax.platforms.gpu import GpuPlatform
from pagedjax.platforms.memory import (
    allocator_fraction,
    fraction_to_set,
    gpu_kv_budget,
    sampler_reserve_bytes,
)
from pagedjax.sampler import XLA_SAMPLING, build_sampling_metadata, sample
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker import worker as worker_module
from pagedjax.worker.worker import AttentionBackendError
from tests.conftest import build_tiny_tokenizer

GIB = 2**30
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 3, 8, 11]]


def generate(engine: LLMEngine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def engine_on(platform, monkeypatch, path, model_config=None, params=None, **options):
    """An engine whose platform is `platform` (a GPU's, here on the CPU)."""
    if platform is not None:
        monkeypatch.setattr(pagedjax.engine, "current_platform", lambda: platform)
    settings = dict(max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=32)
    settings.update(options)
    config = EngineConfig(model=str(path), **settings)
    return LLMEngine(config, model_config, params, build_tiny_tokenizer())


# --------------------------------------------------------------------------- dtype "auto"


def test_dtype_defaults_to_auto_and_is_checked():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float64")


def test_auto_dtype_is_float32_on_the_cpu_and_the_checkpoints_on_a_gpu():
    cpu, gpu = cpu_platform(native=False), GpuPlatform()
    for checkpoint in ("bfloat16", "float16", "float32", None):
        assert cpu.resolve_dtype("auto", checkpoint) == "float32"
        assert gpu.resolve_dtype("auto", checkpoint) == (checkpoint or "bfloat16")
    assert gpu.resolve_dtype("auto", "int8") == "bfloat16"  # not a float type: bf16
    for platform in (cpu, gpu):
        assert platform.resolve_dtype("float16", "bfloat16") == "float16"  # explicit wins


def test_the_checkpoint_dtype_is_read_from_config_json(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama")
    assert checkpoint_dtype(path) == "float32"  # transformers v5 writes "dtype"
    copy = tmp_path / "v4"
    shutil.copytree(path, copy)
    hf = json.loads((copy / "config.json").read_text())
    hf.pop("dtype")
    hf["torch_dtype"] = "bfloat16"  # transformers v4's key
    (copy / "config.json").write_text(json.dumps(hf))
    assert checkpoint_dtype(copy) == "bfloat16"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert checkpoint_dtype(gguf) is None


def test_the_cpu_runs_float32_by_default(tiny, monkeypatch, caplog):
    path, _, config, params = tiny("llama")
    caplog.set_level(logging.INFO, logger="pagedjax")
    auto = engine_on(None, monkeypatch, path, config, params)
    assert auto.config.dtype == "float32"
    assert auto.engine_core.worker.runner.kv_cache.k.dtype == jnp.float32
    assert any("dtype float32 (asked 'auto'" in r.getMessage() for r in caplog.records)
    explicit = engine_on(None, monkeypatch, path, config, params, dtype="float32")
    assert generate(auto) == generate(explicit)


def test_a_gpu_runs_a_bfloat16_checkpoint_in_bfloat16(tiny_model_dir, tmp_path, monkeypatch):
    """Loaded from disk with dtype "auto": weights, activations and the KV pool ("auto"
    follows the resolved dtype) are bfloat16, and the engine's config says so."""
    path, _ = tiny_model_dir("llama")
    bf16 = tmp_path / "bf16"
    shutil.copytree(path, bf16)
    hf = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**hf, "dtype": "bfloat16"}))
    gpu = GpuPlatform(auto_attention=("xla",))  # Pallas' interpret mode is slow on the CPU
    engine = engine_on(gpu, monkeypatch, bf16)
    worker = engine.engine_core.worker
    assert engine.config.dtype == worker.config.dtype == "bfloat16"
    assert worker.params["layers"]["wqkv"].dtype == jnp.bfloat16
    assert worker.runner.kv_cache.k.dtype == jnp.bfloat16
    assert all(len(tokens) == GREEDY.max_tokens for tokens in generate(engine))
    explicit = engine_on(gpu, monkeypatch, bf16, dtype="float32")
    assert explicit.config.dtype == "float32"
    assert explicit.engine_core.worker.runner.kv_cache.k.dtype == jnp.float32


# ---------------------------------------------------------------- the attention fallback


def _raise_at_trace(q, cache, layer, metadata, **kwargs):
    raise RuntimeError("Pallas lowering failed (simulated)\nline two of a long report")


def _raise_at_run(q, cache, layer, metadata, **kwargs):
    def fail(x):
        raise RuntimeError("illegal memory access (simulated)")

    return jax.pure_callback(fail, jax.ShapeDtypeStruct(q.shape, q.dtype), q)


@pytest.fixture
def broken_pallas(monkeypatch):
    """-> install(fn): "pallas" becomes a backend running `fn`; the others stay as they are."""
    real = pagedjax.platforms.get_backend

    def install(fn):
        broken = FunctionBackend("pallas", fn, cost_follows_context=True)
        monkeypatch.setattr(
            pagedjax.platforms,
            "get_backend",
            lambda name: broken if name == "pallas" else real(name),
        )

    return install


def startup_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "failed at start-up" in r.getMessage()
    ]


@pytest.mark.parametrize("failure", [_raise_at_trace, _raise_at_run], ids=["trace", "run"])
def test_a_failing_pallas_falls_back_to_xla_with_one_warning(
    tiny, monkeypatch, caplog, broken_pallas, failure
):
    path, _, config, params = tiny("llama")
    expected = generate(
        engine_on(None, monkeypatch, path, config, params, attention_backend="xla", block_size=16)
    )
    broken_pallas(failure)
    runners = []
    real_runner = worker_module.ModelRunner

    def recorded(*args, **kwargs):
        runners.append(real_runner(*args, **kwargs))
        return runners[-1]

    monkeypatch.setattr(worker_module, "ModelRunner", recorded)
    caplog.set_level(logging.INFO, logger="pagedjax")
    engine = engine_on(GpuPlatform(), monkeypatch, path, config, params)
    warnings = startup_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "'pallas'" in warnings[0] and "(simulated)" in warnings[0] and "'xla'" in warnings[0]
    assert engine.engine_core.worker.attention.name == "xla"
    # The failed runner's pool is freed, whether or not the failed call consumed it.
    assert len(runners) == 2
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(runners[0].kv_cache))
    assert generate(engine) == expected
    assert len(startup_warnings(caplog)) == 1


def test_the_fallback_also_covers_the_profile_compile(tiny, monkeypatch, caplog, broken_pallas):
    """Without explicit KV blocks the pool is sized from a compiled profile of the forward,
    the backend's first compile: a failure there falls back as well."""
    path, _, config, params = tiny("llama")
    broken_pallas(_raise_at_trace)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    stats = {"bytes_limit": 48 << 20, "bytes_in_use": 1 << 20}
    gpu = GpuPlatform(memory_stats=lambda device: stats)
    caplog.set_level(logging.INFO, logger="pagedjax")
    engine = engine_on(gpu, monkeypatch, path, config, params, num_kv_blocks=None)
    assert len(startup_warnings(caplog)) == 1
    assert engine.engine_core.worker.attention.name == "xla"
    assert engine.engine_core.worker.num_blocks > 1000  # from the fake 64 MiB card
    assert all(len(tokens) == GREEDY.max_tokens for tokens in generate(engine))


def test_without_the_fallback_the_error_is_raised(tiny, monkeypatch, caplog, broken_pallas):
    path, _, config, params = tiny("llama")
    broken_pallas(_raise_at_trace)
    with pytest.raises(AttentionBackendError, match="attention_fallback=True") as raised:
        engine_on(GpuPlatform(), monkeypatch, path, config, params, attention_fallback=False)
    assert "'pallas' failed at start-up (RuntimeError: Pallas lowering failed" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)
    # An explicit "pallas" never falls back, whatever the option says.
    with pytest.raises(AttentionBackendError, match="choose another attention_backend"):
        engine_on(GpuPlatform(), monkeypatch, path, config, params, attention_backend="pallas")
    assert startup_warnings(caplog) == []


def test_the_cpu_does_not_probe_its_kernels(tiny, monkeypatch):
    """The CPU's kernels are built and checked when they load: no first step at start-up."""
    path, _, config, params = tiny("llama")
    probes = []
    monkeypatch.setattr(worker_module.Worker, "_probe", lambda self: probes.append(self))
    engine_on(None, monkeypatch, path, config, params)
    assert probes == []
    engine_on(GpuPlatform(auto_attention=("xla",)), monkeypatch, path, config, params)
    assert len(probes) == 1


# ------------------------------------------------------------------------ the KV budget


def test_the_budget_is_a_fraction_of_the_card_capped_by_the_allocator():
    stats = {"bytes_limit": 60 * GIB, "bytes_in_use": 10 * GIB}  # 0.75 of an 80 GiB card
    budget = gpu_kv_budget(stats, 0.9, 0.75, 2 * GIB, 1 * GIB)
    assert budget.card == 80 * GIB
    assert budget.usable == 60 * GIB  # 0.9 of the card is 72 GiB, more than the allocator's
    assert budget.kv_bytes == 47 * GIB
    assert "capped by the allocator's limit" in budget.describe()
    roomier = gpu_kv_budget({**stats, "bytes_limit": 76 * GIB}, 0.9, 0.95, 2 * GIB, 1 * GIB)
    assert roomier.card == 80 * GIB and roomier.kv_bytes == 59 * GIB
    assert "capped" not in roomier.describe()
    assert gpu_kv_budget(stats, 0.1, 0.75, 2 * GIB, 1 * GIB).kv_bytes == 0  # never negative


def test_the_allocator_fraction_is_read_as_jaxlib_reads_it():
    assert allocator_fraction({}) == 0.75
    assert allocator_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == 0.9
    assert allocator_fraction({"XLA_CLIENT_MEM_FRACTION": "0.5"}) == 0.5


def test_gpu_memory_utilization_becomes_the_allocators_fraction_unless_the_user_set_one():
    assert fraction_to_set({}, 0.9) == "0.9"
    assert allocator_fraction({"XLA_CLIENT_MEM_FRACTION": fraction_to_set({}, 0.93)}) == 0.93
    assert fraction_to_set({"XLA_CLIENT_MEM_FRACTION": "0.5"}, 0.9) is None
    assert fraction_to_set({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}, 0.9) is None


RESERVE_THEN_START = """
import os, jax
from pagedjax.platforms import reserve_device_memory
reserve_device_memory(0.93)
jax.devices()  # the backends start: a GPU's allocator would take what the variable says
reserve_device_memory(0.5)  # too late to change it: nothing happens
print(os.environ.get("XLA_CLIENT_MEM_FRACTION"))
"""


@pytest.mark.parametrize(
    "env, expected",
    [({}, "0.93"), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}, "None")],
    ids=["unset", "user-set"],
)
def test_the_fraction_is_set_before_the_backends_start_and_only_then(env, expected):
    """In a fresh interpreter, as the engine does it before it asks JAX for a device."""
    environ = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k}
    got = subprocess.run(
        [sys.executable, "-c", RESERVE_THEN_START],
        env={**environ, **env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    assert got == expected


def test_the_engine_reserves_the_card_before_it_asks_for_a_platform(tiny, monkeypatch):
    path, _, config, params = tiny("llama")
    calls = []
    monkeypatch.setattr(
        pagedjax.engine, "reserve_device_memory", lambda u: calls.append(("reserve", u))
    )
    real = pagedjax.engine.current_platform
    monkeypatch.setattr(
        pagedjax.engine, "current_platform", lambda: calls.append(("platform",)) or real()
    )
    engine_on(None, monkeypatch, path, config, params, gpu_memory_utilization=0.85).shutdown()
    assert calls[:2] == [("reserve", 0.85), ("platform",)]


def test_the_gpu_platform_budgets_from_its_memory_stats(monkeypatch, caplog):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.8")
    stats = {"bytes_limit": 64 * GIB, "bytes_in_use": 3 * GIB}  # an 80 GiB card
    gpu = GpuPlatform(memory_stats=lambda device: stats)
    config = EngineConfig(max_num_seqs=100, gpu_memory_utilization=0.7)
    caplog.set_level(logging.INFO, logger="pagedjax")
    got = gpu.kv_budget_bytes(config, lambda: GIB, vocab_size=50_000)
    reserve = sampler_reserve_bytes(128, 50_000)  # rows: max_num_seqs' power-of-two bucket
    assert got == int(0.7 * 80 * GIB) - 3 * GIB - GIB - reserve
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget")]
    assert len(lines) == 1
    for part in ("70% of the card's 80.00 GiB", "3.00 GiB in use", "1.00 GiB activation peak"):
        assert part in lines[0]
    assert "sampler reserve" in lines[0]
    assert GpuPlatform(memory_stats=lambda device: None).kv_budget_bytes(config, lambda: 0, 10) == (
        DEFAULT_KV_BYTES
    )


def test_the_sampler_reserve_covers_the_compiled_sampler():
    """The reserve holds the logits and the XLA sampler's temporaries with every feature on."""
    rows, vocab = 16, 4096
    wanted = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1, logprobs=5
    )
    meta = build_sampling_metadata([wanted] * rows, [[3, 4, 5]] * rows, [2] * rows, [0] * rows)
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
    compiled = sample.lower(logits, meta, XLA_SAMPLING, num_logprobs=5).compile()
    used = compiled.memory_analysis().temp_size_in_bytes + rows * vocab * 4
    assert used <= sampler_reserve_bytes(rows, vocab)
    assert np.isclose(used, sampler_reserve_bytes(rows, vocab), rtol=0.2)  # and not far above


# ------------------------------------------------ a pool the Pallas kernels read in place


def test_a_pool_sized_from_memory_avoids_the_fp8_range_the_kernels_copy(caplog):
    """An fp8 pool of 2-4 GiB is one the Pallas kernels can only read through a per-call copy
    of its layer: a pool sized from a budget stays under 2 GiB instead; other dtypes, other
    backends and the draft's own backend keep every block."""
    from types import SimpleNamespace

    from kernels_pallas.paged_attention import PALLAS
    from kernels_pallas.pallas_common import int32_offsets_overflow
    from kernels_pallas.xla_attention import XLA
    from pagedjax.core.memory import KVCacheSpec
    from pagedjax.worker.worker import Worker

    fp8 = KVCacheSpec(30, 8, 128, jnp.float8_e4m3fn)  # 491,520 elements a 16-token block
    per_block = 30 * 8 * 16 * 128

    def fit(num_blocks, attention=PALLAS, spec=fp8, draft=None):
        worker = SimpleNamespace(
            attention=attention, device_kv_spec=spec, draft=draft,
            config=SimpleNamespace(block_size=16),
        )  # fmt: skip
        return Worker.fit_num_blocks(worker, num_blocks)

    caplog.set_level(logging.INFO, logger="pagedjax")
    blocks = 6000  # a 2.75 GiB pool
    assert int32_offsets_overflow((30, 8, blocks, 16, 128), jnp.float8_e4m3fn)
    fitted = fit(blocks)
    assert fitted == 2**31 // per_block < blocks
    assert not int32_offsets_overflow((30, 8, fitted, 16, 128), jnp.float8_e4m3fn)
    assert int32_offsets_overflow((30, 8, fitted + 1, 16, 128), jnp.float8_e4m3fn)
    assert any("instead of 6000" in r.getMessage() for r in caplog.records)
    assert fit(fitted) == fitted  # under 2 GiB, and past 4 GiB: every block
    assert fit(9000) == 9000  # 4.1 GiB: 64-bit offsets
    assert fit(blocks, spec=KVCacheSpec(30, 8, 128, jnp.bfloat16)) == blocks
    assert fit(blocks, attention=XLA) == blocks
    # a bf16 target beside an fp8 draft on the Pallas kernels: the draft's pool decides
    draft = SimpleNamespace(attention=PALLAS, kv_spec=fp8)
    assert fit(blocks, spec=KVCacheSpec(30, 8, 128, jnp.bfloat16), draft=draft) == fitted
    draft_on_xla = SimpleNamespace(attention=XLA, kv_spec=fp8)
    assert fit(blocks, attention=XLA, draft=draft_on_xla) == blocks


def test_a_gpu_refuses_batch_invariance_saying_what_is_missing():
    with pytest.raises(ValueError, match="Pallas attention has an invariant mode.*matmuls"):
        GpuPlatform().batch_invariant_backend(None, jnp.float32)
