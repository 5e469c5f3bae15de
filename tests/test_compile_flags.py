"""The test run's quicker XLA:CPU code generation (tests/conftest.py) changes no number: a tiny
model's tokens and every logprob, prompt and sampled, are the same bits as with XLA's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import _QUICK_COMPILE

SCRIPT = """
import json, sys
from pagedjax import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=32, block_size=16, max_model_len=128)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5,
                        prompt_logprobs=5)
outputs = llm.generate([[3, 5, 7, 9, 11, 13, 17], [4, 8, 15, 16, 23, 42]], params, False)
def bits(steps):
    return [{k: v.logprob.hex() for k, v in step.items()} for step in steps if step]
print("RESULT " + json.dumps([(o.outputs[0].token_ids, bits(o.outputs[0].logprobs),
                               bits(o.prompt_logprobs)) for o in outputs]))
"""


def _start(model_dir: str, flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-c", SCRIPT, model_dir]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(process: subprocess.Popen) -> list:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    return json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])


def test_quick_compilation_keeps_every_bit(tiny_model_dir):
    path = str(tiny_model_dir("llama")[0])
    runs = [_start(path, _QUICK_COMPILE), _start(path, "")]  # at once: mostly one core each
    quick, default = (_result(run) for run in runs)
    assert len(quick) == 2 and all(len(tokens) == 8 for tokens, _, _ in quick)
    assert quick == default
