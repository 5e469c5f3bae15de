"""The C++ kernels' instruction-set levels (`pagedjax/cpu_native/build.py`): the best level
this machine runs by default, `PAGEDJAX_CPU_ISA` forcing a lower one (so one machine runs every
path: here, end to end), a clear error for a level it cannot run; and `int8_activations`'
errors. The kernels' bits per level are tested in test_cpu_native_matmul.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedjax.cpu_native import build


def generate(path: str) -> dict:
    """This process's level, a batch-invariant engine's greedy tokens, and whether a sampled
    request's logprobs are the same bits alone and beside others."""
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    prompts = [[1, 5, 9, 2, 7], [3, 3, 4], [8] * 20]
    llm = LLM(path, max_model_len=64, num_kv_blocks=16, block_size=8, batch_invariant=True)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    sampling = SamplingParams(temperature=1.0, seed=5, logprobs=0, max_tokens=12, ignore_eos=True)

    def logprobs(outs) -> list[float]:
        c = outs[0].outputs[0]
        return [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)]

    alone = logprobs(llm.generate(prompts[:1], sampling, use_tqdm=False))
    beside = logprobs(llm.generate(prompts, sampling, use_tqdm=False))
    return {"isa": build.isa(), "tokens": tokens, "invariant": alone == beside}


GENERATE = (
    "import json, sys; from test_cpu_isa import generate; print(json.dumps(generate(sys.argv[1])))"
)


def run_generate(path, level: str) -> dict:
    """generate() in a process of its own at `level`."""
    env = dict(os.environ, **{build.ISA_ENV: level})
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(path)],
        capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_levels_are_best_first_and_the_default_is_the_best():
    levels = build.levels()
    assert levels and build.isa() == (os.environ.get(build.ISA_ENV) or levels[0])
    known = [*build.X86_LEVELS, build.NATIVE]
    assert levels == sorted(levels, key=known.index)
    if levels != [build.NATIVE]:
        assert levels[-1] == "generic"  # the portable build runs on every x86-64


def test_a_level_this_machine_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "sse9")
    build.isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="PAGEDJAX_CPU_ISA='sse9'.*unset it"):
            build.isa()
    finally:
        monkeypatch.delenv(build.ISA_ENV)
        build.isa.cache_clear()
    with pytest.raises(ValueError, match="does not run"):
        build.load("sse9")


@pytest.mark.slow
def test_every_level_gives_the_best_levels_tokens_and_stays_invariant(tiny):
    """The engine forced to each lower SIMD level (a process each, as a user sets the variable)
    gives the default level's greedy tokens on a tiny Llama, and at every level the
    batch-invariant engine gives a request's logprobs bit for bit alone and in a batch."""
    path = str(tiny("llama")[0])
    best = generate(path)  # this process: the best level, unless the variable is set
    assert best["isa"] == build.isa() and best["invariant"]
    # The lower x86 levels but the portable one, whose kernels' bits test_cpu_native_matmul
    # checks: end to end it only adds minutes of software FMAs to CI.
    lower = build.levels()[build.levels().index(build.isa()) + 1 :]
    for level in [level for level in lower if level != "generic"]:
        forced = run_generate(path, level)
        assert forced == {"isa": level, "tokens": best["tokens"], "invariant": True}, level


def test_int8_activations_need_the_cpus_kernels_and_float32(tiny):
    from pagedjax.llm import LLM
    from pagedjax.platforms import Platform, current_platform

    with pytest.raises(ValueError, match="int8_activations=True runs on the CPU"):
        Platform.with_int8_activations(current_platform())  # what a GPU platform answers
    with pytest.raises(ValueError, match="dtype float32 and tensor_parallel_size 1"):
        LLM(tiny("llama")[0], int8_activations=True, dtype="bfloat16", max_model_len=64)
