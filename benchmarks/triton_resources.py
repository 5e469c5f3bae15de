"""What the GPU gets from the Pallas kernels, measured without one: each kernel lowered for CUDA
and compiled to a cubin by the `triton` package for sm_90 (H100/H200) and sm_80 (A100), at the
shapes the engine and `benchmarks/kernels.py` run (see kernels_pallas/triton_compile.py).

    python benchmarks/triton_resources.py [--out benchmarks/results]

Per kernel: registers per thread, spilled bytes per thread, shared memory per program,
programs resident per SM, tensor-core instructions (wgmma / mma.sync) and pipelined KV loads
(cp.async). Needs `pip install triton` (in the test extras); no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax.numpy as jnp  # noqa: E402

from kernels_pallas.triton_compile import (  # noqa: E402
    compile_for_sm,
    lower_for_cuda,
    triton_kernels,
)

# (label, head_dim, GQA group, KV dtype): the default model, the kernel benchmark's
# Llama-3-8B-like heads, and head_dim 256.
SHAPES = [
    ("SmolLM2-135M", 64, 3, jnp.float32),
    ("SmolLM2-135M", 64, 3, jnp.bfloat16),
    ("Llama-3-8B", 128, 4, jnp.float32),
    ("Llama-3-8B", 128, 4, jnp.bfloat16),
    ("Llama-3-8B", 128, 4, jnp.float8_e4m3fn),
    ("head_dim 256", 256, 8, jnp.bfloat16),
    ("head_dim 256", 256, 8, jnp.float8_e4m3fn),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--capabilities", default="90,80")
    args = parser.parse_args()

    import triton

    rows = []
    header = (
        f"{'shape':13} {'kv':6} {'kernel':6} {'sm':>3} {'regs':>4} {'spill':>5} "
        f"{'smem KiB':>8} {'per SM':>6} {'wgmma':>5} {'mma':>4} {'cp.async':>8}"
    )
    print(f"triton {triton.__version__}\n{header}")
    for label, head_dim, group, kv_dtype in SHAPES:
        for kernel in ("ragged", "decode"):
            for capability in (int(c) for c in args.capabilities.split(",")):
                start = time.perf_counter()
                lowered = lower_for_cuda(
                    kernel,
                    kv_dtype=kv_dtype,
                    head_dim=head_dim,
                    group=group,
                    num_kv_heads=8,
                    capability=capability,
                )
                [triton_kernel] = triton_kernels(lowered)
                compiled = compile_for_sm(triton_kernel, capability)
                dtype = jnp.dtype(kv_dtype).name.replace("float8_e4m3fn", "fp8")
                dtype = dtype.replace("float32", "f32").replace("bfloat16", "bf16")
                print(
                    f"{label:13} {dtype:6} {kernel:6} {capability:>3} {compiled.registers:>4} "
                    f"{compiled.stack_bytes:>5} {compiled.shared_bytes / 1024:>8.1f} "
                    f"{compiled.blocks_per_sm:>6} {compiled.wgmma:>5} {compiled.mma_sync:>4} "
                    f"{compiled.cp_async:>8}",
                    flush=True,
                )
                rows.append(
                    {
                        "shape": label,
                        "head_dim": head_dim,
                        "group": group,
                        "kv_dtype": jnp.dtype(kv_dtype).name,
                        "kernel": kernel,
                        **dataclasses.asdict(compiled),
                        "blocks_per_sm": compiled.blocks_per_sm,
                        "compile_s": round(time.perf_counter() - start, 2),
                    }
                )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "triton_resources.json"
    path.write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
