"""Peak host memory while loading a sharded bf16 Hugging Face checkpoint to run in bf16.

    python benchmarks/load_memory.py [--hidden 1024] [--layers 8] [--peer-source DIR]
    python benchmarks/load_memory.py --smoke

A random Llama is saved in bf16 in several safetensors files; a fresh process starts JAX,
resets its peak-RSS mark (/proc/self/clear_refs) and loads it with `load_model(dtype=bf16)`.
Reported: the peak RSS growth over the checkpoint's bytes. It counts the files' mapped pages
(page cache: the kernel reclaims them under pressure) and, on the CPU, the device's copy of
the weights; so the floor is about 2x here, of which a GPU host keeps the files' share only.
--peer-source: the same in the same run for another checkout (an earlier commit's), and the
ratio. Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from report import add_smoke_flag, report
from workloads import ROOT, save_random_llama

CHILD = """
import json, sys
import jax, jax.numpy as jnp
jax.numpy.zeros(1).block_until_ready()  # the backend's own memory, before the mark
from models.loader import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM, the peak, to the current RSS
config, params = load_model(sys.argv[1], jnp.bfloat16)
jax.block_until_ready(params)
kinds = sorted({str(a.dtype) for a in jax.tree.leaves(params)})
print(json.dumps({"peak_growth": status("VmHWM") - before, "dtypes": kinds}))
"""


def measure(model: Path, source: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(source))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)],
        env=env, capture_output=True, text=True, check=True, cwd=source,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def save_checkpoint(hidden: int, layers: int, vocab_size: int = 32000) -> Path:
    """A random Llama of that shape in bf16, in files of at most 20 MB (saved once)."""
    return save_random_llama(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 128,
        dtype="bfloat16", chat_template=False, max_shard_size="20MB",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--peer-source", type=Path, default=None, help="another checkout")
    add_smoke_flag(parser)
    args = parser.parse_args()
    hidden, layers = (256, 2) if args.smoke else (args.hidden, args.layers)
    model = save_checkpoint(hidden, layers, vocab_size=2048 if args.smoke else 32000)
    files = sorted(model.glob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in files)
    result = {"checkpoint_bytes": checkpoint, "shards": len(files)}
    for name, source in (("now", ROOT), ("peer", args.peer_source)):
        if source is None:
            continue
        got = measure(model, source.resolve())
        result[f"{name}_peak_growth_bytes"] = got["peak_growth"]
        result[f"{name}_peak_over_checkpoint"] = got["peak_growth"] / checkpoint
        result[f"{name}_dtypes"] = got["dtypes"]
        print(f"{name}: peak RSS growth {got['peak_growth'] / 2**20:.0f} MiB = "
              f"{got['peak_growth'] / checkpoint:.2f}x the {checkpoint / 2**20:.0f} MiB "
              f"checkpoint ({len(files)} files), weights {got['dtypes']}")  # fmt: skip
    if args.peer_source is not None:
        ratio = result["peer_peak_growth_bytes"] / result["now_peak_growth_bytes"]
        result["peer_over_now"] = ratio
        print(f"peer / now: {ratio:.2f}x")
    report("load_memory", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
