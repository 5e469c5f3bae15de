"""What the GPU gets from the Pallas kernels, measured without one: each kernel lowered for CUDA
and compiled to a cubin by the `triton` package for sm_90 (H100/H200) and sm_80 (A100), at the
shapes the engine and `benchmarks/paged_kernels.py` run (see benchmarks/triton_compile.py).

    python benchmarks/triton_resources.py [--out benchmarks/results] [--capabilities 90,80]
        [--smoke (one shape and one tuning candidate, sm_90 only)]

Per kernel: registers per thread, spilled bytes per thread, shared memory per program,
programs resident per SM, tensor-core instructions (wgmma / mma.sync) and asynchronous KV
loads (cp.async); then the same for the tuning candidates `paged_kernels.py` times. Needs
`pip install triton` (in the test extras); no GPU.
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
from paged_kernels import TUNING_VARIANTS  # noqa: E402  (benchmarks/ is the script directory)
from report import add_smoke_flag, results_dir, skip  # noqa: E402
from triton_compile import compile_kernel, missing_requirement  # noqa: E402

from kernels_pallas.decode_attention import DecodeConfig  # noqa: E402
from kernels_pallas.ragged_paged_attention import RaggedConfig  # noqa: E402

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


def compile_row(
    label: str,
    head_dim: int,
    group: int,
    kv_dtype: jnp.dtype | type,
    kernel: str,
    capability: int,
    config: RaggedConfig | DecodeConfig | None = None,
) -> dict:
    start = time.perf_counter()
    compiled = compile_kernel(
        kernel,
        capability,
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        group=group,
        num_kv_heads=8,
        config=config,
    )
    return {
        "shape": label,
        "head_dim": head_dim,
        "group": group,
        "kv_dtype": jnp.dtype(kv_dtype).name,
        "kernel": kernel,
        "config": repr(config) if config is not None else "default",
        **dataclasses.asdict(compiled),
        "blocks_per_sm": compiled.blocks_per_sm,
        "compile_s": round(time.perf_counter() - start, 2),
    }


def print_row(row: dict, name: str) -> None:
    dtype = row["kv_dtype"].replace("float8_e4m3fn", "fp8")
    dtype = dtype.replace("float32", "f32").replace("bfloat16", "bf16")
    print(
        f"{row['shape']:13} {dtype:6} {name:28} {row['capability']:>3} {row['registers']:>4} "
        f"{row['stack_bytes']:>5} {row['shared_bytes'] / 1024:>8.1f} {row['blocks_per_sm']:>6} "
        f"{row['wgmma']:>5} {row['mma_sync']:>4} {row['cp_async']:>8}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results")
    parser.add_argument("--capabilities", default="90,80")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path for one SM; flags still win
        parser.set_defaults(capabilities="90")
    args = parser.parse_args()
    args.out = args.out or results_dir(args.smoke)
    if args.smoke and (missing := missing_requirement()):
        skip(f"needs {missing}")
    import triton

    # A smoke run compiles the default model's bf16 shape and the first tuning candidate.
    shapes = SHAPES[1:2] if args.smoke else SHAPES
    variants_of = {"ragged": TUNING_VARIANTS["ragged"]} if args.smoke else TUNING_VARIANTS

    capabilities = [int(c) for c in args.capabilities.split(",")]
    rows = []
    header = (
        f"{'shape':13} {'kv':6} {'kernel':28} {'sm':>3} {'regs':>4} {'spill':>5} "
        f"{'smem KiB':>8} {'per SM':>6} {'wgmma':>5} {'mma':>4} {'cp.async':>8}"
    )
    print(f"triton {triton.__version__}\n{header}")
    for label, head_dim, group, kv_dtype in shapes:
        for kernel in ("ragged", "decode"):
            for capability in capabilities:
                rows.append(compile_row(label, head_dim, group, kv_dtype, kernel, capability))
                print_row(rows[-1], kernel)
    # The tuning candidates benchmarks/paged_kernels.py times on a GPU, at its bf16 shape.
    for kernel, variants in variants_of.items():
        for name, config in variants.items():
            for capability in capabilities:
                row = compile_row("Llama-3-8B", 128, 4, jnp.bfloat16, kernel, capability, config)
                rows.append({**row, "variant": name})
                print_row(row, name.removeprefix("pallas_"))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "triton_resources.json"
    path.write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
