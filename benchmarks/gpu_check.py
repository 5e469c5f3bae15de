"""One prepared GPU check, safe to run blind: ten stages, each in its own subprocesses with its
own time budget, so a hang or a CUDA fault is killed, reported, and the next stage still runs.

    python benchmarks/gpu_check.py --out DIR [--cpu] [--only smoke,bench]

1. env           versions (python, jax, jaxlib, the jax CUDA plugin, triton, torch, transformers,
                 numpy), nvidia-smi and jax.devices()                         -> env.txt
2. smoke         each kernel case compiled (interpret=False) in its own process against the
                 float32 oracle (tests/attention_cases.py tolerances), run twice (a moving result
                 is a race): PASS / FAIL / TIMEOUT / CRASH(signal), max error   -> smoke.json
3. kernel_tests  tests/test_pallas_kernels.py and tests/test_grouped_matmul.py compiled,
                 per-test and overall timeouts             -> kernel_tests.log, kernel_tests.xml
4. bench         benchmarks/paged_kernels.py --quick --large-pool: our kernels vs JAX's bundled
                 Pallas paged attention, KV GB/s against a measured copy bandwidth
                                                                     -> bench.log, bench.json
5. engine        a tiny random Llama (transformers, saved locally) through the engine with the
                 Pallas backend, greedy tokens against transformers' own; on a GPU also the KV
                 budget against the card's real size, and the fallback to XLA's attention on a
                 real Triton refusal (tiles no GPU holds)                   -> engine.json
6. host          benchmarks/host_overhead.py --generate --async-only: the engine's ms per
                 token-step and its host share at 256 rows, 1 and 8 decode steps per dispatch,
                 and 1 with steady decode steps off (the peer)
                                                                       -> host.log, host.json
7. throughput    benchmarks/gpu_throughput.py: offline output tok/s, 256 requests x 128 greedy
                 tokens on a random model of SmolLM2-135M's shape, against transformers'
                 generate on the same card                 -> throughput.log, throughput.json
8. moe           a tiny gpt-oss through the engine (Pallas attention with sinks, the Pallas
                 experts) against transformers' greedy tokens; benchmarks/moe.py: grouped
                 experts against every expert computed                  -> moe.log, moe.json
(memory, between env and smoke: gpu_memory_utilization as the allocator's limit; last,
command_buffers: the host stage's run with XLA's command buffers off and with loops.)
The PASS/FAIL and GB/s table is printed last and written to summary.txt.
`--cpu`: the same script on the CPU (interpret mode, tiny sizes) so it cannot rot (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "GPU_CHECK_RESULT "  # a child's result line: MARK + json
STAGES = [
    "env", "memory", "smoke", "kernel_tests", "bench", "engine", "host", "throughput", "moe",
    "command_buffers",
]  # fmt: skip
# Seconds per stage (--budget STAGE=SECONDS changes one). GPU: with the driver's slack, the 8
# minutes one device call is planned for; sized from the stage times of the first GPU run
# (benchmarks/README.md), with room to spare; the host stage (a traced run more per
# configuration since) is not yet timed on a GPU.
BUDGETS = {
    "gpu": dict(
        env=20, memory=20, smoke=50, kernel_tests=120, bench=80, engine=90, host=130,
        throughput=150, moe=90, command_buffers=90,
    ),
    "cpu": dict(
        env=60, memory=60, smoke=240, kernel_tests=180, bench=180, engine=240, host=120,
        throughput=120, moe=240, command_buffers=120,
    ),
}  # fmt: skip
# The whole run's cap: one device call is at most 600 s, and the table must come out before it
# ends. The last stage gets what the others leave (the budgets add up to more).
TOTAL_CAP = {"gpu": 570, "cpu": 2400}
# XLA:GPU's command buffers (CUDA graphs) for the command_buffers stage: XLA_FLAGS each run adds.
COMMAND_BUFFERS = {
    "off": "--xla_gpu_enable_command_buffer=",
    "with_loops": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
}
SMOKE_CASE_TIMEOUT = {"gpu": 60, "cpu": 150}
SMOKE_JOBS = {"gpu": 4, "cpu": 2}  # smoke processes at once (no preallocation: they share the GPU)
# name: kernel, KV pool dtype, head_dim, KV heads, query heads per KV head, sequence mix
SMOKE_CASES = {
    "ragged-f32-d64-gqa2": ("ragged", "float32", 64, 2, 2, "mixed"),
    "ragged-bf16-d64-gqa3": ("ragged", "bfloat16", 64, 3, 3, "mixed"),
    "ragged-bf16-d128-gqa4": ("ragged", "bfloat16", 128, 8, 4, "mixed"),
    "ragged-fp8-d128-gqa4": ("ragged", "float8_e4m3fn", 128, 8, 4, "mixed"),
    "decode-f32-d64-gqa2": ("decode", "float32", 64, 2, 2, "many"),
    "decode-bf16-d64-gqa3-splitk": ("decode", "bfloat16", 64, 3, 3, "long"),
    "decode-bf16-d128-gqa4": ("decode", "bfloat16", 128, 8, 4, "many"),
    "decode-fp8-d128-gqa4": ("decode", "float8_e4m3fn", 128, 8, 4, "many"),
}
# The dry run's cases: each kernel once (the narrowest pool and split-K); the kernels themselves
# are tested in tests/test_pallas_kernels.py, the dry run keeps the plumbing.
SMOKE_CASES_CPU = ("ragged-fp8-d128-gqa4", "decode-bf16-d64-gqa3-splitk")
# (q_len, context) per sequence; "long" has few long sequences, so split-K uses several splits.
SEQS = {
    "gpu": {
        "mixed": [(1, 1024), (100, 100), (64, 700), (1, 1), (17, 333), (1, 517), (128, 900)],
        "many": [(1, c) for c in [1, 2048, 17, 1000, 64, 1500] * 8],
        "long": [(1, 8000), (1, 3000), (1, 1), (1, 300)],
    },
    "cpu": {
        "mixed": [(7, 7), (1, 40), (20, 45), (1, 1), (3, 70), (1, 9)],
        "many": [(1, 200), (1, 1), (1, 37), (1, 129), (1, 64)],
        "long": [(1, 600), (1, 1)],
    },
}
# The bench targets, on decode at 64 sequences x 2k context, bf16 (tiny on the CPU).
TARGET_CASE = {"gpu": "decode_64x2k", "cpu": "decode_2x256"}
TARGET_COPY_FRACTION, TARGET_SPEEDUP = 0.80, 1.5
# Our kernels' largest error against the XLA reference in the benchmark's cases (bf16 and fp8
# outputs near 1: about 4e-3 when right, order 1 when pages are misread).
BENCH_MAX_ERROR = 0.1


# --- children: each runs in its own process and prints MARK + json last -------------------------


def probe() -> dict:
    import jax
    import jax.numpy as jnp
    import jaxlib

    device = jax.devices()[0]
    return dict(
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=[repr(d) for d in jax.devices()],
        device_kind=device.device_kind,
        compute_capability=getattr(device, "compute_capability", None),
        core_count=getattr(device, "core_count", None),
        sum_of_ones=float(jnp.ones(1024).sum()),  # the device computes
    )


def nvidia_smi_bytes() -> int:
    """The card's memory by nvidia-smi; 0 where there is none."""
    if not shutil.which("nvidia-smi"):
        return 0
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    return int(smi.stdout.split()[0]) * 2**20 if smi.returncode == 0 else 0


def memory_run(utilization: float = 0.9) -> dict:
    """A fresh process, as an engine starts one: gpu_memory_utilization becomes JAX's allocator
    fraction before JAX starts (`reserve_device_memory`), so the allocator's limit is that
    share of nvidia-smi's size (it was 0.75 whatever the option said). The CPU has no
    allocator statistics: there only the variable is checked."""
    from pagedjax.platforms import reserve_device_memory

    reserve_device_memory(utilization)
    import jax

    fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION")
    stats = jax.devices()[0].memory_stats() or {}
    limit, smi = stats.get("bytes_limit", 0), nvidia_smi_bytes()
    share = limit / smi if limit and smi else None
    ok = fraction == f"{utilization:g}" and (share is None or abs(share - utilization) < 0.02)
    return dict(
        status="PASS" if ok else "FAIL",
        gpu_memory_utilization=utilization,
        xla_client_mem_fraction=fraction,
        allocator_bytes_limit=limit,
        nvidia_smi_bytes=smi,
        limit_over_card=share,
    )


def smoke_case(name: str, mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from attention_cases import TOLERANCE, expected, make_case, quantize_fp8

    from kernels_pallas.decode_attention import choose_num_splits
    from kernels_pallas.paged_attention import paged_attention, resolve_interpret

    kernel, dtype_name, head_dim, kv_heads, group, mix = SMOKE_CASES[name]
    dtypes = {jnp.dtype(t).name: t for t in TOLERANCE}
    kv_dtype, fp8 = dtypes[dtype_name], dtype_name.startswith("float8")
    atol, rtol = TOLERANCE[kv_dtype]
    seqs, block_size = SEQS[mode][mix], 16
    q, cache, metadata = make_case(
        7, seqs, block_size=block_size, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
        kv_dtype=jnp.float32 if fp8 else kv_dtype, num_seqs_padded=len(seqs) + 2,
        num_tokens_padded=sum(q for q, _ in seqs) + 5,
    )  # fmt: skip
    scale, scales = head_dim**-0.5, {}
    if fp8:  # per-KV-head scales, as the engine's fp8 pools carry
        rng = np.random.default_rng(8)
        draw = lambda: jnp.asarray(rng.uniform(0.5, 2, kv_heads), jnp.float32)
        scales = {"k_scale": draw(), "v_scale": draw()}
        cache = quantize_fp8(cache, scales["k_scale"], scales["v_scale"])
        q = q.astype(jnp.bfloat16)
    decode_only = kernel == "decode"
    fn = jax.jit(
        lambda q, c, m, s: paged_attention(q, c, 1, m, scale=scale, decode_only=decode_only, **s)
    )
    start = time.perf_counter()
    out = np.asarray(fn(q, cache, metadata, scales).astype(jnp.float32))
    first_call_s = time.perf_counter() - start
    again = np.asarray(fn(q, cache, metadata, scales).astype(jnp.float32))
    want = expected(q, cache, 1, metadata, scale=scale, **scales)
    real = int(metadata.query_start_loc[-1])
    error = np.abs(out[:real] - want[:real])
    rel = float(np.linalg.norm(out[:real] - want[:real]) / np.linalg.norm(want[:real]))
    checks = {
        "compiled": mode == "cpu" or (not resolve_interpret() and jax.default_backend() == "gpu"),
        "within_tolerance": bool(np.allclose(out[:real], want[:real], atol=atol, rtol=rtol)),
        "finite": bool(np.isfinite(out).all()),
        "padding_zero": bool((out[real:] == 0).all()),
        "repeatable": bool(np.array_equal(out, again, equal_nan=True)),
    }
    result = dict(
        status="PASS" if all(checks.values()) else "FAIL",
        checks=checks,
        max_abs_error=float(error.max()),
        rel_l2_error=rel,
        tolerance=dict(atol=atol, rtol=rtol),
        interpret=resolve_interpret(),
        backend=jax.default_backend(),
        tokens=real,
        seqs=len(seqs),
        first_call_s=round(first_call_s, 2),
    )
    if decode_only:
        width = metadata.block_tables.shape[1] * block_size
        result["num_splits"] = choose_num_splits(len(seqs) + 2, kv_heads, width)
    return result


def engine_run(mode: str) -> dict:
    """A tiny random Llama through the engine (Pallas backend) against transformers' greedy."""
    import numpy as np
    import torch
    import transformers

    from tests.conftest import build_tiny_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # as tests/conftest.py: random norms too, weights large enough to matter
        for param_name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1.0 + 0.2 * noise if "norm" in param_name else 0.15 * noise)
    path = Path(tempfile.mkdtemp(prefix="gpu_check_llama_"))  # under the driver's scratch
    model.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer(128).save_pretrained(path)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, n).tolist() for n in (5, 23, 47, 64)]
    max_tokens = 16 if mode == "gpu" else 6
    want, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids, gaps = list(prompt), []
            for _ in range(max_tokens):
                top2 = model(torch.tensor([ids])).logits[0, -1].topk(2)
                ids.append(int(top2.indices[0]))
                gaps.append(float(top2.values[0] - top2.values[1]))
            want.append(ids[len(prompt) :])
            margins.append(gaps)

    import jax

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(
        str(path), attention_backend="pallas", max_model_len=128, num_kv_blocks=64,
        max_num_seqs=8, max_num_batched_tokens=32,  # chunked prefills beside decode tokens
    )  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    mismatches = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if list(g) != w:
            diffs = [j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b]
            at = diffs[0] if diffs else min(len(g), len(w))
            gap = margins[i][at] if at < len(margins[i]) else None
            mismatches.append(dict(prompt=i, first_diff=at, hf_top2_logit_gap=gap))
    worker = llm.llm_engine.engine_core.worker
    attention = worker.attention.name
    memory = kv_budget_run(path, prompts[0]) if mode == "gpu" else {"status": "PASS"}
    fallback = fallback_run(path, prompts, want, max_tokens) if mode == "gpu" else {}
    return dict(
        status=(
            "PASS"
            if not mismatches
            and attention == "pallas"
            and memory["status"] == "PASS"
            and fallback.get("status", "PASS") == "PASS"
            else "FAIL"
        ),
        memory=memory,
        fallback=fallback,
        attention_backend=attention,
        backend=jax.default_backend(),
        prompts=len(prompts),
        prompt_lens=[len(p) for p in prompts],
        max_tokens=max_tokens,
        token_identical=not mismatches,
        mismatches=mismatches,
        engine_s=round(seconds, 2),
        compilations=getattr(getattr(worker, "runner", None), "num_compilations", None),
    )


def moe_engine_run(mode: str) -> dict:
    """A tiny random gpt-oss (tests/conftest.py's: attention sinks, YaRN, experts with biases
    and the clamped SwiGLU, sliding layers) through the engine on the Pallas backend, its
    experts on the platform's grouped matmul, against transformers' greedy tokens."""
    import numpy as np
    import torch

    from tests.conftest import build_tiny_hf_model, build_tiny_tokenizer

    model = build_tiny_hf_model("gpt_oss")
    path = Path(tempfile.mkdtemp(prefix="gpu_check_gpt_oss_"))  # under the driver's scratch
    model.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer(128).save_pretrained(path)
    rng = np.random.default_rng(1)
    # The dry run's two prompts prefill in one step: its plumbing, in fewer compilations.
    lengths = (5, 23, 40) if mode == "gpu" else (5, 23)
    prompts = [rng.integers(3, 128, n).tolist() for n in lengths]
    max_tokens = 12 if mode == "gpu" else 4
    want = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(str(path), attention_backend="pallas", max_model_len=128, num_kv_blocks=32,
              max_num_batched_tokens=32)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    worker = llm.llm_engine.engine_core.worker
    experts = type(worker.params["layers"]["experts_gate_up"]).__name__
    identical = got == want
    return dict(
        status="PASS" if identical and worker.attention.name == "pallas" else "FAIL",
        token_identical=identical,
        attention_backend=worker.attention.name,
        experts=experts,
    )


@contextlib.contextmanager
def pagedjax_log(level: int):
    """The messages pagedjax logs at `level` and above inside the block, as a list."""
    messages: list[str] = []
    handler, log = logging.Handler(level), logging.getLogger("pagedjax")
    handler.emit = lambda record: messages.append(record.getMessage())
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(min(level, log.getEffectiveLevel()))
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def fallback_run(path: Path, prompts: list, want: list, max_tokens: int) -> dict:
    """A real Pallas failure on the device: "pallas" becomes the real kernels with tiles that
    no GPU's shared memory holds, so Triton refuses them at the first compile; the default
    engine (attention_backend="auto") must warn once and give the same tokens on XLA's
    attention. "no failure" if the oversized kernels compiled after all."""
    import functools

    import pagedjax.platforms
    from kernels_pallas.decode_attention import DecodeConfig
    from kernels_pallas.paged_attention import PALLAS, paged_attention
    from kernels_pallas.ragged_paged_attention import RaggedConfig
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    oversized = functools.partial(
        paged_attention,
        ragged_config=RaggedConfig(rows_per_program=512, kv_tile_tokens=2048, num_stages=8),
        decode_config=DecodeConfig(kv_tile_tokens=2048, num_stages=8),
    )
    broken = dataclasses.replace(PALLAS, fn=oversized)
    real = pagedjax.platforms.get_backend
    pagedjax.platforms.get_backend = lambda name: broken if name == "pallas" else real(name)
    try:
        with pagedjax_log(logging.WARNING) as messages:
            llm = LLM(str(path), max_model_len=128, num_kv_blocks=64, max_num_seqs=8,
                      max_num_batched_tokens=32)  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        pagedjax.platforms.get_backend = real
    warnings = [m for m in messages if "failed at start-up" in m]
    attention = llm.llm_engine.engine_core.worker.attention.name
    identical = [list(g) for g in got] == want
    if attention == "pallas":
        status = "PASS" if identical else "FAIL"  # nothing failed: nothing to fall back from
        return dict(status=status, outcome="no failure: the oversized tiles compiled")
    return dict(
        status="PASS" if attention == "xla" and len(warnings) == 1 and identical else "FAIL",
        outcome=f"fell back to {attention}",
        warnings=[w[:400] for w in warnings],
        token_identical=identical,
    )


def kv_budget_run(path: Path, prompt: list[int]) -> dict:
    """An engine sized from the card's memory (gpu_memory_utilization, no num_kv_blocks): the
    card's size as the budget works it out from JAX's allocator limit against nvidia-smi's, the
    logged split, and one request served from the large pool."""
    import jax

    from pagedjax.llm import LLM
    from pagedjax.platforms.memory import allocator_fraction
    from pagedjax.sampling_params import SamplingParams

    utilization = 0.5  # beside the first engine, which still holds its memory
    with pagedjax_log(logging.INFO) as messages:
        llm = LLM(str(path), attention_backend="pallas", max_model_len=128, max_num_seqs=8,
                  gpu_memory_utilization=utilization)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    card = limit / allocator_fraction(os.environ)
    smi_bytes = nvidia_smi_bytes()  # the card's size, where nvidia-smi is
    engine_stats = llm.llm_engine.engine_core.stats()
    kv_bytes = engine_stats.get("kv_cache_bytes_per_device", 0)
    ratio = card / smi_bytes if smi_bytes else None
    return dict(
        status="PASS" if ratio and abs(ratio - 1) < 0.03 and len(tokens) == 4 else "FAIL",
        allocator_bytes_limit=limit,
        allocator_fraction=allocator_fraction(os.environ),
        card_bytes_worked_out=int(card),
        nvidia_smi_bytes=smi_bytes,
        card_over_smi=ratio,
        gpu_memory_utilization=utilization,
        kv_cache_bytes=kv_bytes,
        kv_fraction_of_card=kv_bytes / smi_bytes if smi_bytes else None,
        kv_blocks=engine_stats.get("kv_blocks_total"),
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
        log=[line for line in messages if "KV" in line or "dtype" in line][:6],
    )


# --- the driver ------------------------------------------------------------------------------


RUNNING: set[int] = set()  # process groups of the children running now


def stop_children(signum: int, _frame: object) -> None:
    """The driver is stopped (e.g. its caller's timeout): take the children with it."""
    for group in list(RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    print(f"gpu_check: stopped by {signal.Signals(signum).name}", flush=True)
    os._exit(128 + signum)  # now: no waiting for the stage's other threads


def run_child(cmd: list[str], limit: float, log: Path, env: dict) -> tuple[str, int | None, float]:
    """Runs cmd in its own process group (same session: a caller that ends the session ends it
    too), output to log; kills the group at the limit.
    Returns (PASS|FAIL|TIMEOUT|CRASH(SIG...), return code, seconds)."""
    start = time.perf_counter()
    # Python 3.10 lacks process_group (and preexec_fn is unsafe beside the smoke threads).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, **group
        )
        RUNNING.add(proc.pid)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "TIMEOUT", None, time.perf_counter() - start
        finally:
            RUNNING.discard(proc.pid)
    seconds = time.perf_counter() - start
    if rc in (124, 137) and cmd[0] == "timeout":  # GNU timeout's codes: it hit its limit
        return "TIMEOUT", rc, seconds
    signum = -rc if rc < 0 else rc - 128 if rc > 128 and cmd[0] == "timeout" else 0
    if signum:
        return f"CRASH({signal.Signals(signum).name})", rc, seconds
    return ("PASS" if rc == 0 else "FAIL"), rc, seconds


def child_result(log: Path) -> dict | None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(MARK)]
    return json.loads(lines[-1][len(MARK) :]) if lines else None


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def last_line(path: Path) -> str:
    """The log's last exception line (else its last line)."""
    lines = [line.strip() for line in tail(path, 6000).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:100]


def bench_error(case: dict, label: str, timing: dict) -> str:
    """Why a timing of paged_kernels.py's report is wrong ("" if it is not): an error, a non-finite
    output, or more than BENCH_MAX_ERROR from the XLA reference."""
    if "error" in timing:
        return "ERROR"
    error = timing.get("max_abs_error_vs_reference")  # --large-pool cases: per timing
    error = (case.get("max_abs_error_vs_reference") or {}).get(label, error)
    if timing.get("finite") is False:
        return "NOT FINITE"
    return f"ERR {error:.3g} > {BENCH_MAX_ERROR}" if error and error > BENCH_MAX_ERROR else ""


def step_detail(report: dict, name: str) -> str:
    """One run of `host_overhead.py --generate --trace`: its time per token-step, the host's
    share, and what the trace saw of the device."""
    text = (
        f"{name.replace('_async_on', '')}: {report[f'{name}_ms_per_token_step']:.2f} ms/token-step "
        f"(host {report[f'{name}_host_ms_per_token_step']:.2f})"
    )
    if f"{name}_trace_error" in report:
        text += f", trace: {report[f'{name}_trace_error'][:80]}"
    elif f"{name}_trace_device_ops_per_step" in report:
        text += (
            f", {report[f'{name}_trace_device_ops_per_step']:.0f} device ops, device idle "
            f"{report[f'{name}_trace_device_idle_share']:.0%}, gap between steps "
            f"{report[f'{name}_trace_step_gap_ms_median']:.2f} ms"
        )
    return text


class Check:
    def __init__(self, args: argparse.Namespace):
        self.mode = "cpu" if args.cpu else "gpu"
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.start = time.perf_counter()
        self.results: dict[str, dict] = {}
        self.budgets = dict(BUDGETS[self.mode])
        for item in args.budget:
            stage, _, seconds = item.partition("=")
            self.budgets[stage] = float(seconds)
        self.total = min(
            sum(self.budgets[s] for s in args.only.split(",")) + 20, TOTAL_CAP[self.mode]
        )
        self.env = dict(os.environ)
        self.env.update(
            JAX_PLATFORMS=self.mode if self.mode == "cpu" else "cuda",
            PAGEDJAX_PALLAS_INTERPRET="1" if self.mode == "cpu" else "0",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
            TF_CPP_MIN_LOG_LEVEL="1",
        )

    def limit(self, stage: str, remaining_stages: int) -> float:
        left = self.total - (time.perf_counter() - self.start) - 5 * remaining_stages
        return max(5.0, min(self.budgets[stage], left))

    def me(self, *flags: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), *flags] + (
            ["--cpu"] if self.mode == "cpu" else []
        )

    def stage_env(self, limit: float) -> dict:
        lines = [f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"]
        lines.append(f"python: {sys.version.split()[0]} ({sys.executable})")
        for package in ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                        "jax-cuda12-plugin", "jax-cuda12-pjrt", "triton", "torch",
                        "transformers", "numpy"]:  # fmt: skip
            try:
                lines.append(f"{package}: {importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                if "cuda" not in package:
                    lines.append(f"{package}: not installed")
        if not any("cuda" in line for line in lines):
            lines.append("jax cuda plugin: not installed")
        if shutil.which("nvidia-smi"):
            query = "--query-gpu=name,memory.total,driver_version,clocks.max.sm"
            try:
                smi = subprocess.run(
                    ["nvidia-smi", query, "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=15,
                )  # fmt: skip
                lines.append(f"nvidia-smi: {(smi.stdout or smi.stderr).strip()}")
            except subprocess.TimeoutExpired:
                lines.append("nvidia-smi: TIMEOUT")
        else:
            lines.append("nvidia-smi: not found")
        log = self.scratch / "probe.log"
        status, rc, seconds = run_child(self.me("--probe"), limit, log, self.env)
        info = child_result(log)
        if info is None:
            lines.append(f"jax probe: {status} (rc {rc})\n{tail(log)}")
            status = status if status != "PASS" else "FAIL"
        else:
            lines += [f"jax.{key}: {value}" for key, value in info.items()]
            if self.mode == "gpu" and info["backend"] != "gpu":
                status = "FAIL"
        text = "\n".join(lines) + "\n"
        (self.out / "env.txt").write_text(text)
        print(text, flush=True)
        detail = f"{info['device_kind']}, jax {info['jax']}" if info else last_line(log)
        return dict(status=status, seconds=seconds, detail=detail)

    def stage_memory(self, limit: float) -> dict:
        log = self.out / "memory.log"
        status, rc, seconds = run_child(self.me("--memory-run"), limit, log, self.env)
        result = child_result(log) or {}
        result["status"] = result.get("status", "FAIL") if status == "PASS" else status
        (self.out / "memory.json").write_text(json.dumps(result, indent=2))
        share = result.get("limit_over_card")
        detail = (
            f"gpu_memory_utilization 0.9: allocator limit {share:.3f} of the card"
            if share
            else f"XLA_CLIENT_MEM_FRACTION={result.get('xla_client_mem_fraction')}"
            if result
            else last_line(log)
        )
        return dict(status=result["status"], seconds=seconds, detail=detail)

    def stage_smoke(self, limit: float) -> dict:
        deadline = time.perf_counter() + limit
        env = dict(self.env, XLA_PYTHON_CLIENT_PREALLOCATE="false")

        def one(name: str) -> dict:
            log = self.scratch / f"smoke_{name}.log"
            case_limit = min(SMOKE_CASE_TIMEOUT[self.mode], deadline - time.perf_counter())
            if case_limit < 5:
                return dict(status="TIMEOUT", detail="not started: stage budget spent")
            status, rc, seconds = run_child(self.me("--smoke-case", name), case_limit, log, env)
            result = child_result(log) or {}
            result["status"] = result.get("status", "FAIL") if status == "PASS" else status
            result.update(rc=rc, seconds=round(seconds, 1))
            if result["status"] != "PASS":
                result["log_tail"] = tail(log)
                result.setdefault("detail", last_line(log))
            line = f"  smoke {name:28s} {result['status']:14s} {seconds:5.1f}s\n"
            sys.stdout.write(line)  # one write: the cases finish on several threads
            sys.stdout.flush()
            return result

        names = SMOKE_CASES_CPU if self.mode == "cpu" else tuple(SMOKE_CASES)
        with ThreadPoolExecutor(SMOKE_JOBS[self.mode]) as pool:
            cases = dict(zip(names, pool.map(one, names), strict=True))
        (self.out / "smoke.json").write_text(json.dumps(cases, indent=2))
        passed = sum(c["status"] == "PASS" for c in cases.values())
        return dict(
            status="PASS" if passed == len(cases) else "FAIL",
            detail=f"{passed}/{len(cases)} cases pass",
            cases=cases,
        )

    def stage_kernel_tests(self, limit: float) -> dict:
        xml, log = self.out / "kernel_tests.xml", self.out / "kernel_tests.log"
        # -n 0: one process (the suite's default runs a file per core: on a GPU each worker
        # would take its own share of the card, and -v's lines would come per worker).
        cmd = [sys.executable, "-m", "pytest", "tests/test_pallas_kernels.py",
               "tests/test_grouped_matmul.py", "tests/test_mosaic_decode.py", "-v", "-n", "0",
               "-p", "no:cacheprovider", f"--junitxml={xml}", "--durations=10",
               "-o", "faulthandler_timeout=60"]  # fmt: skip
        if importlib.util.find_spec("pytest_timeout"):  # fails a stuck test, the run goes on
            cmd += ["--timeout=90", "--timeout-method=signal"]
        if self.mode == "cpu":  # a few fast tests: the plumbing, not the kernels
            cmd += ["-k", "decode_split_k_bf16 or software_fp8 or split_count or supports"]
        if shutil.which("timeout"):  # SIGINT first, so pytest still prints and writes its summary
            cmd = ["timeout", "--signal=INT", "--kill-after=15", str(max(5, int(limit) - 20))] + cmd
        status, rc, seconds = run_child(cmd, limit, log, self.env)
        text = log.read_text(errors="replace") if log.exists() else ""
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        try:
            suite = ET.parse(xml).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            counts = {key: int(suite.get(key, 0)) for key in counts}
        except (OSError, ET.ParseError):  # killed before the summary: count the -v lines
            counts["tests"] = len(re.findall(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED)", text))
            counts["failures"] = len(re.findall(r"::\S+ FAILED", text))
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        if status == "PASS" and counts["tests"] == 0:
            status = "FAIL"
        detail = (
            f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped"
        )
        outcome = re.compile(r" (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
        unfinished = [  # -v prints the test's name, then its outcome when it ends
            line.strip() for line in text.splitlines()
            if line.startswith("tests/") and "::" in line and not outcome.search(line)
        ]  # fmt: skip
        if status != "PASS" and unfinished:
            detail += f"; stopped in {unfinished[-1].split('::', 1)[1]}"
        return dict(status=status, rc=rc, seconds=seconds, detail=detail, **counts)

    def stage_bench(self, limit: float) -> dict:
        bench_dir = self.scratch / "bench"
        cmd = [sys.executable, "benchmarks/paged_kernels.py", "--out", str(bench_dir), "--quick"]
        # --large-pool (GPU only: slow interpreted): pools past 4 GiB, 64-bit offsets
        cmd += (
            ["--tiny", "--iters", "2"] if self.mode == "cpu" else ["--iters", "20", "--large-pool"]
        )
        status, rc, seconds = run_child(cmd, limit, self.out / "bench.log", self.env)
        report = {}
        if (bench_dir / "kernels.json").exists():  # rewritten after every case: partial too
            shutil.copy(bench_dir / "kernels.json", self.out / "bench.json")
            report = json.loads((bench_dir / "kernels.json").read_text())
        cases = report.get("cases", [])
        ours_failed = [  # our kernels must run, and match the reference where checked
            f"{c['case']}/{label}"
            for c in cases
            for label, timing in c["timings"].items()
            if label.startswith("pallas") and bench_error(c, label, timing)
        ]
        if status == "PASS" and (ours_failed or not cases):
            status = "FAIL"
        copy_bw = report.get("copy_bandwidth_gb_per_s")
        detail = f"{len(cases)} cases" + (f", copy {copy_bw:.0f} GB/s" if copy_bw else "")
        detail += f"; errors in {', '.join(ours_failed)}" if ours_failed else ""
        return dict(status=status, rc=rc, seconds=seconds, detail=detail, report=report)

    def stage_engine(self, limit: float) -> dict:
        log = self.scratch / "engine.log"
        env = dict(self.env, TMPDIR=str(self.scratch))  # the saved model goes with the scratch
        status, rc, seconds = run_child(self.me("--engine-run"), limit, log, env)
        result = child_result(log) or {}
        result["status"] = result.get("status", "FAIL") if status == "PASS" else status
        result.update(rc=rc, seconds=round(seconds, 1), log_tail=tail(log, 3000))
        (self.out / "engine.json").write_text(json.dumps(result, indent=2))
        if "token_identical" in result:
            detail = (
                f"{result['prompts']} prompts x {result['max_tokens']} tokens, "
                f"{result['attention_backend']} backend: "
                + ("token-identical" if result["token_identical"] else "MISMATCH")
            )
            if result.get("fallback", {}).get("outcome"):
                detail += f"; real Pallas failure: {result['fallback']['outcome']}"
            memory = result.get("memory", {})
            if memory.get("card_over_smi"):
                detail += (
                    f"; KV budget: card worked out {memory['card_over_smi']:.3f}x nvidia-smi's, "
                    f"pool {memory['kv_fraction_of_card']:.0%} of the card"
                )
        else:
            detail = last_line(log)
        return dict(status=result["status"], seconds=seconds, detail=detail)

    def run_benchmark(
        self, stage: str, args: list[str], result: str, limit: float, **env: str
    ) -> tuple[str, float, dict]:
        """A benchmark script's run as a stage (`env`: variables it adds): (status, seconds,
        its report or {}); the log and the report go to $OUT as STAGE.log and STAGE.json."""
        results = self.scratch / stage
        env = dict(self.env, PAGEDJAX_BENCH_RESULTS=str(results), TMPDIR=str(self.scratch), **env)
        log = self.out / f"{stage}.log"
        status, rc, seconds = run_child([sys.executable, *args], limit, log, env)
        where = results if self.mode == "cpu" else ROOT / "benchmarks" / "results"
        path = where / f"{result}.json"
        report = json.loads(path.read_text()) if status == "PASS" and path.exists() else {}
        (self.out / f"{stage}.json").write_text(json.dumps(report, indent=2))
        if not report and status == "PASS":
            status = "FAIL"
        return status, seconds, report

    def stage_moe(self, limit: float) -> dict:
        """Mixtures of experts (issue 43; the grouped kernel compiled in the kernel tests): a
        tiny gpt-oss through the engine (Pallas attention with sinks, the Pallas experts on a
        GPU) against transformers' greedy tokens, then a Qwen3-MoE-shaped model's decode and
        prefill steps, grouped against every expert computed (`benchmarks/moe.py`)."""
        log = self.scratch / "moe_engine.log"
        env = dict(self.env, TMPDIR=str(self.scratch))
        engine_status, _, engine_s = run_child(self.me("--moe-run"), limit / 2, log, env)
        engine = child_result(log) or {}
        engine_ok = engine_status == "PASS" and engine.get("status") == "PASS"
        args = ["benchmarks/moe.py"] + (["--smoke"] if self.mode == "cpu" else ["--repeats", "5"])
        status, seconds, report = self.run_benchmark("moe", args, "moe", limit - engine_s)
        engine_detail = f"gpt-oss engine ({engine.get('experts')} experts): " + (
            "token-identical" if engine.get("token_identical") else f"FAIL {last_line(log)}"
        )
        if not engine_ok:
            status = "FAIL" if status == "PASS" else status
        if not report:
            return dict(status=status, detail=f"{engine_detail}; {last_line(self.out / 'moe.log')}")
        detail = ", ".join(
            f"{row['step']}: {row['grouped_tok_s']:.0f} tok/s, {row['speedup']:.2f}x dense"
            for row in report["rows"]
        )
        return dict(status=status, seconds=engine_s + seconds, detail=f"{engine_detail}; {detail}")

    def stage_host(self, limit: float) -> dict:
        """The engine's host cost per decode step at 256 rows (issue 41): `host_overhead.py
        --generate` on a model whose device work is small, one decode step per dispatch and 8,
        async scheduling on; the CPU dry run takes its smoke sizes."""
        args = ["benchmarks/host_overhead.py", "--generate", "--async-only", "--trace"]
        args += ["--smoke"] if self.mode == "cpu" else ["--steps", "64"]
        status, seconds, report = self.run_benchmark("host", args, "host_overhead_generate", limit)
        if not report:
            return dict(status=status, detail=last_line(self.out / "host.log"))
        names = ("k1_async_on", "k8_async_on", "k1_async_on_general")  # the last: the peer
        ran = [name for name in names if f"{name}_ms_per_token_step" in report]  # smoke: no peer
        detail = "; ".join(step_detail(report, name) for name in ran)
        rows = report["running_requests"]
        return dict(status=status, seconds=seconds, detail=f"{rows} rows; {detail}")

    def stage_throughput(self, limit: float) -> dict:
        """Issue 41's measure of the whole engine: `gpu_throughput.py`, offline output tok/s
        of 256 requests x 128 greedy tokens on a random model of SmolLM2-135M's shape, against
        transformers' `generate` on the same card in the same run; the CPU dry run takes its
        smoke sizes."""
        args = ["benchmarks/gpu_throughput.py"] + (["--smoke"] if self.mode == "cpu" else [])
        status, seconds, report = self.run_benchmark("throughput", args, "gpu_throughput", limit)
        if not report:
            return dict(status=status, detail=last_line(self.out / "throughput.log"))
        engine = report["engine_output_tok_per_s"]
        detail = (
            f"{report['requests']} x {report['tokens']} tokens: engine {engine:,.0f} tok/s "
            f"({report['engine_attention']}, {report['engine_dtype']})"
        )
        if "peer_output_tok_per_s" in report:
            detail += (
                f", transformers {report['peer_output_tok_per_s']:,.0f} tok/s: "
                f"{report['engine_over_peer']:.2f}x"
            )
        return dict(status=status, seconds=seconds, detail=detail)

    def stage_command_buffers(self, limit: float) -> dict:
        """XLA's command buffers (CUDA graphs) for the step (issue 41): the host stage's run
        at one decode step per dispatch again, with them off and with loops (the layer scan)
        captured too, each in a process of its own (XLA_FLAGS is read at start-up)."""
        args = ["benchmarks/host_overhead.py", "--generate", "--async-only", "--trace"]
        args += ["--multi-step", "1", "--no-peer"]
        args += ["--smoke"] if self.mode == "cpu" else ["--steps", "64"]
        flags = self.env.get("XLA_FLAGS", "")
        details, statuses, start = [], [], time.perf_counter()
        configs = list(COMMAND_BUFFERS.items())
        if self.mode == "cpu":  # XLA:CPU ignores the GPU's flags: one run keeps the plumbing
            configs = configs[-1:]
        for i, (name, flag) in enumerate(configs):
            left = limit - (time.perf_counter() - start)
            share = left / (len(configs) - i)
            status, _, report = self.run_benchmark(
                f"command_buffers_{name}", args, "host_overhead_generate", share,
                XLA_FLAGS=f"{flags} {flag}".strip(),
            )  # fmt: skip
            statuses.append(status)
            details.append(f"{name}: " + (step_detail(report, "k1_async_on") if report else status))
        status = next((s for s in statuses if s != "PASS"), "PASS")
        return dict(status=status, detail="; ".join(details))

    def run(self, only: list[str]) -> int:
        chosen = [s for s in STAGES if s in only]
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, stop_children)
        for i, stage in enumerate(chosen):
            limit = self.limit(stage, len(chosen) - i - 1)
            print(f"== {stage} (budget {limit:.0f}s)", flush=True)
            start = time.perf_counter()
            try:
                result = getattr(self, f"stage_{stage}")(limit)
            except Exception as error:  # the driver's own bug: report it, run the next stage
                result = dict(status="FAIL", detail=f"driver error: {error!r}"[:300])
            result["seconds"] = time.perf_counter() - start
            self.results[stage] = result
            print(f"== {stage}: {result['status']} in {result['seconds']:.0f}s", flush=True)
        shutil.rmtree(self.scratch, ignore_errors=True)  # what matters is under --out
        summary = self.summary()
        (self.out / "summary.txt").write_text(summary + "\n")
        print(summary, flush=True)
        return 0 if all(r["status"] == "PASS" for r in self.results.values()) else 1

    def summary(self) -> str:
        lines = [f"gpu_check ({self.mode}), {time.perf_counter() - self.start:.0f}s in all"]
        lines.append(f"{'stage':14s} {'result':13s} {'time':>5s}  detail")
        for stage, result in self.results.items():
            lines.append(
                f"{stage:14s} {result['status']:13s} {result['seconds']:4.0f}s  {result['detail']}"
            )
            for name, case in result.get("cases", {}).items():
                error, detail = case.get("max_abs_error"), case.get("detail", "")
                if error is not None:
                    detail = f"max err {error:.2e} (atol=rtol={case['tolerance']['atol']:g})"
                lines.append(f"  {name:28s} {case['status']:13s} {detail}")
        report = self.results.get("bench", {}).get("report") or {}
        copy_bw = report.get("copy_bandwidth_gb_per_s") or 0
        if report.get("cases"):
            read_bw = report.get("read_bandwidth_gb_per_s")
            torch_bw = report.get("torch_copy_bandwidth_gb_per_s")
            lines.append(
                f"bench: {report.get('device')}, copy {copy_bw:.0f} GB/s (read + write)"
                + (f", read {read_bw:.0f} GB/s" if read_bw else "")
                + (f", torch copy {torch_bw:.0f} GB/s" if torch_bw else "")
            )
            lines.append(
                f"  {'case':22s} {'kv':9s} {'kernel':28s} {'us':>9s} {'GB/s':>6s} copy% read%"
            )
            for case in report["cases"]:
                for label, t in case["timings"].items():
                    row = f"  {case['case']:22s} {case['kv_dtype'][:9]:9s} {label[:28]:28s}"
                    if "error" in t:
                        lines.append(f"{row} ERROR {t['error'][:60]}")
                    else:
                        error = bench_error(case, label, t)
                        read = t.get("fraction_of_read_bw")
                        lines.append(
                            f"{row} {t['us']:9.1f} {t['kv_gb_per_s']:6.0f} "
                            f"{t['fraction_of_copy_bw']:5.0%} "
                            + (f"{read:5.0%}" if read else "    -")
                            + (f" {error}" if error else "")
                        )
                if "skipped" in case:
                    lines.append(f"  {case['case']:22s} skipped: {case['skipped'][:60]}")
            lines.append(self.targets(report))
        overall = all(r["status"] == "PASS" for r in self.results.values())
        lines.append(f"OVERALL: {'PASS' if overall else 'FAIL'}")
        return "\n".join(lines)

    def targets(self, report: dict) -> str:
        name = TARGET_CASE[self.mode]
        case = next(
            (c for c in report["cases"] if c["case"] == name and c["kv_dtype"] == "bfloat16"), None
        )
        if case is None:
            return f"targets: {name} bf16 not in bench.json"
        ours = case["timings"].get("pallas_split_k", {})
        peer = case["timings"].get("jax_bundled_paged_attention", {})
        if "us" not in ours:
            return f"targets: {name} bf16: our split-K kernel has no timing"
        fraction = ours["fraction_of_copy_bw"]
        met = "MET" if fraction >= TARGET_COPY_FRACTION else "MISSED"
        text = (
            f"targets on {name} bf16 (split-K): {fraction:.0%} of copy bandwidth "
            f"(>= {TARGET_COPY_FRACTION:.0%}: {met})"
        )
        if ours.get("fraction_of_read_bw"):
            text += f", {ours['fraction_of_read_bw']:.0%} of read bandwidth"
        if "us" in peer:
            speedup = peer["us"] / ours["us"]
            met = "MET" if speedup >= TARGET_SPEEDUP else "MISSED"
            text += f", {speedup:.2f}x JAX's bundled kernel (>= {TARGET_SPEEDUP}x: {met})"
        else:
            text += ", JAX's bundled kernel: no timing"
        ours_timed = {k: t["us"] for k, t in case["timings"].items() if "pallas" in k and "us" in t}
        return text + f"; fastest of ours: {min(ours_timed, key=ours_timed.get)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU, tiny sizes")
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages")
    parser.add_argument(
        "--budget", action="append", default=[], metavar="STAGE=SECONDS", help="a stage's budget"
    )
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke-case", choices=list(SMOKE_CASES), help=argparse.SUPPRESS)
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--moe-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = "cpu" if args.cpu else "gpu"
    if args.probe or args.smoke_case or args.engine_run or args.memory_run or args.moe_run:
        if args.probe:  # a child
            result = probe()
        elif args.memory_run:
            result = memory_run()
        elif args.moe_run:
            result = moe_engine_run(mode)
        elif args.smoke_case:
            result = smoke_case(args.smoke_case, mode)
        else:
            result = engine_run(mode)
        print(MARK + json.dumps(result), flush=True)
        return
    unknown = set(args.only.split(",") + [b.partition("=")[0] for b in args.budget]) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; stages: {STAGES}")
    sys.exit(Check(args).run(args.only.split(",")))


if __name__ == "__main__":
    main()
