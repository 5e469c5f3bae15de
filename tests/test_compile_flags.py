"""The test run's quicker XLA:CPU code generation (tests/conftest.py) changes no number: tiny
models' tokens and every logprob, prompt and sampled, greedy and seeded sampling with penalties,
are the same bits as with XLA's defaults. Three families whose steps differ most: Llama, Gemma 3
(soft-capping, GELU, sliding windows) and gpt-oss (experts, attention sinks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import _QUICK_COMPILE

SCRIPT = """
import json, sys
from pagedjax import LLM, SamplingParams
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5,
                        prompt_logprobs=5)
sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=3, max_tokens=8,
                         ignore_eos=True, logprobs=3, presence_penalty=0.5,
                         repetition_penalty=1.2)
def bits(steps):
    return [{k: v.logprob.hex() for k, v in step.items()} for step in steps if step]
results = []
for model_dir in sys.argv[1:]:
    llm = LLM(model_dir, num_kv_blocks=32, block_size=16, max_model_len=128)
    for params in (greedy, sampled):
        outputs = llm.generate([[3, 5, 7, 9, 11, 13, 17], [4, 8, 15, 16, 23, 42]], params, False)
        results += [(o.outputs[0].token_ids, bits(o.outputs[0].logprobs),
                     bits(o.prompt_logprobs or [])) for o in outputs]
print("RESULT " + json.dumps(results))
"""


def _start(model_dirs: list[str], flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-c", SCRIPT, *model_dirs]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(process: subprocess.Popen) -> list:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    return json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])


def test_quick_compilation_keeps_every_bit(tiny_model_dir):
    paths = [str(tiny_model_dir(name)[0]) for name in ("llama", "gemma3", "gpt_oss")]
    runs = [_start(paths, _QUICK_COMPILE), _start(paths, "")]  # at once: one core each
    quick, default = (_result(run) for run in runs)
    assert len(quick) == 3 * 2 * 2 and all(len(tokens) == 8 for tokens, _, _ in quick)
    assert quick == default
