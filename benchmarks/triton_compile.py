"""What a GPU would make of the Pallas kernels, found on any host.

jaxlib lowers a Pallas-Triton kernel to Triton IR (TTIR) without a GPU; with the CUDA plugin
it then compiles the IR at lowering with its own copy of the pipeline of Triton's Python
compiler (TTIR -> TTGIR -> LLVM -> PTX; `ptxas` makes the cubin). The `triton` package runs
that pipeline for a named SM target without a GPU (`ptxas` ships in its wheel), so a CPU-only
host can see what the GPU gets: registers per thread, spills, shared memory, the tensor-core
instructions chosen (`wgmma` on Hopper, `mma.sync` before it) and whether the KV loads are
software-pipelined (`cp.async`). jaxlib builds its own Triton, so the numbers are a close
estimate, not the GPU's own.

    python benchmarks/triton_compile.py [--kernels ragged,decode] [--capability 90]
        [--head-dim 128] [--group 4] [--kv-dtype bfloat16] [--smoke (head_dim 64, group 2)]

A developer tool, not part of the runtime package (it imports jaxlib's private `jax._src`):
`benchmarks/triton_resources.py` and `tests/test_triton_compile.py` use it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from kernels_pallas.decode_attention import DecodeConfig, decode_attention_kernel
from kernels_pallas.ragged_paged_attention import RaggedConfig, ragged_paged_attention_kernel

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"

# Dynamic shared memory one block may use, in bytes (CUDA's per-block opt-in maximum), and
# what one SM has (CUDA reserves 1 KiB of it per resident block).
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
SM_SHARED_BYTES = {80: 167936, 86: 102400, 89: 102400, 90: 233472}
SM_REGISTERS, SM_WARPS, SM_BLOCKS = 65536, 64, 32  # sm_86/89 have 48 warps; close enough


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas kernel as jaxlib embeds it for XLA: Triton IR plus launch options."""

    name: str
    ir: bytes  # TTIR as MLIR bytecode
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """Resource use of one kernel compiled for `sm_{capability}`."""

    name: str
    capability: int
    num_warps: int
    num_stages: int
    registers: int  # per thread
    stack_bytes: int  # per thread; > 0 means spilled registers (the kernels make no calls)
    shared_bytes: int  # per block
    wgmma: int  # Hopper warpgroup MMA instructions in the PTX
    mma_sync: int  # Ampere-style warp MMA instructions
    cp_async: int  # asynchronous global -> shared copies: pipelined loads

    @property
    def tensor_core_ops(self) -> int:
        return self.wgmma + self.mma_sync

    @property
    def blocks_per_sm(self) -> int:
        """Programs resident on one SM at once, as CUDA's occupancy calculator counts them
        (registers allocated per warp in units of 256)."""
        registers_per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = SM_REGISTERS // (registers_per_warp * self.num_warps)
        by_shared = SM_SHARED_BYTES[self.capability] // (self.shared_bytes + 1024)
        return min(by_registers, by_shared, SM_WARPS // self.num_warps, SM_BLOCKS)


def triton_call_targets(lowered: jax.stages.Lowered) -> list[str]:
    """Custom-call targets of `lowered` that hold a Triton kernel (IR, or PTX on newer jaxlibs
    with a GPU, which compile at lowering)."""
    return [target for target, _ in _custom_calls(lowered) if "triton" in target]


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Triton IR kernels that `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
    embedded (jaxlib 0.10 and 0.11 leave their compilation to XLA)."""
    kernels = []
    for target, attrs in _custom_calls(lowered):
        if target != TRITON_CALL_TARGET:
            continue
        config = ir.DictAttr(attrs["mhlo.backend_config"])
        kernels.append(
            TritonKernel(
                name=ir.StringAttr(config["name"]).value,
                ir=ir.StringAttr(config["ir"]).value_bytes,
                num_warps=ir.IntegerAttr(config["num_warps"]).value,
                num_stages=ir.IntegerAttr(config["num_stages"]).value,
            )
        )
    return kernels


def _custom_calls(lowered: jax.stages.Lowered) -> list[tuple[str, Any]]:  # (target, attributes)
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        attrs = inner.operation.attributes
                        found.append((ir.StringAttr(attrs["call_target_name"]).value, attrs))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def triton_ir_text(kernel: TritonKernel) -> str:
    """Parses and verifies the kernel's Triton IR with jaxlib's dialect; returns it as text."""
    from jax._src.lib.triton import dialect as tt_dialect  # only jaxlibs that embed the IR

    context = mlir.JaxIrContext()
    context.append_dialect_registry(mlir.upstream_dialects)
    tt_dialect.register_dialect(context)
    context.load_all_available_dialects()
    with context:
        module = ir.Module.parse(kernel.ir)
        if not module.operation.verify():
            raise ValueError(f"Triton IR of {kernel.name} does not verify")
        return str(module)


def missing_requirement() -> str | None:
    """What this host lacks to compile the kernels (None: nothing): the `triton` package with
    its NVIDIA tools, and jaxlib's Triton dialect."""
    try:
        import triton
    except ImportError:
        return "the triton package (Linux wheels)"
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(os.path.join(tools, tool), os.X_OK):
            return f"triton's {tool} (its NVIDIA backend)"
    try:
        from jax._src.lib.triton import dialect  # noqa: F401
    except ImportError:
        return "a jaxlib with the Triton dialect"
    return None


def compile_for_sm(kernel: TritonKernel, capability: int = 90) -> CompiledKernel:
    """Compiles `kernel` to a cubin for `sm_{capability}` with the `triton` package and reads
    its resource use. Needs `pip install triton` (Linux x86-64), not a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    text = triton_ir_text(kernel)
    if capability < 89 and "tt.fp_to_fp" in text:  # LLVM would abort the process
        raise ValueError(
            f"{kernel.name} converts fp8 in hardware, which sm_{capability} cannot: lower it "
            "with software_fp8=True"
        )
    with tempfile.TemporaryDirectory() as tmp:
        ttir = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(ttir, "w") as f:
            f.write(text)
        compiled = triton.compile(
            ttir,
            target=GPUTarget("cuda", capability, 32),
            options={
                "num_warps": kernel.num_warps,
                "num_stages": kernel.num_stages,
                "enable_fp_fusion": True,  # the default before Triton 3.10
            },
        )
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage}")
    ptx = compiled.asm["ptx"]
    return CompiledKernel(
        name=kernel.name,
        capability=capability,
        num_warps=kernel.num_warps,
        num_stages=kernel.num_stages,
        registers=int(match[1]),
        stack_bytes=int(match[2]),
        shared_bytes=compiled.metadata.shared,
        wgmma=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync\b", ptx)),
        cp_async=len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)),
    )


def lower_for_cuda(
    kernel: str,  # "ragged" or "decode"
    *,
    kv_dtype: jnp.dtype | type,
    head_dim: int,
    group: int,
    block_size: int = 16,
    num_kv_heads: int = 2,
    use_window: bool = False,
    soft_cap: float | None = None,
    config: RaggedConfig | DecodeConfig | None = None,  # None: the kernel's default
    num_tokens: int = 64,
    num_seqs: int = 8,
    capability: int = 90,
) -> jax.stages.Lowered:
    """Lowers one of the two kernels for a CUDA target from shapes alone (no arrays, no GPU),
    as `paged_attention` would on a GPU of `capability` (below 89: fp8 upcast in software).
    q is float32 for a float32 pool, else bfloat16; 3 layers, 64 pages of 16 table entries."""
    num_layers, num_blocks, width = 3, 64, 16
    kv_dtype = jnp.dtype(kv_dtype)
    pool = jax.ShapeDtypeStruct(
        (num_layers, num_kv_heads, num_blocks, block_size, head_dim), kv_dtype
    )
    q_dtype = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    scales = None if kv_dtype.itemsize != 1 else jax.ShapeDtypeStruct((), jnp.float32)
    static = dict(
        scale=0.1,
        soft_cap=soft_cap,
        use_window=use_window,
        interpret=False,
        software_fp8=capability < 89,
    )
    if kernel == "ragged":
        fn = functools.partial(
            ragged_paged_attention_kernel, config=config or RaggedConfig(), **static
        )
        q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), q_dtype)
        args = (q, pool, pool, i32(()), i32((num_seqs + 1,)), i32((num_seqs,)))
    elif kernel == "decode":
        fn = functools.partial(
            decode_attention_kernel, config=config or DecodeConfig(num_splits=4), **static
        )
        q = jax.ShapeDtypeStruct((num_seqs, num_kv_heads * group, head_dim), q_dtype)
        args = (q, pool, pool, i32(()), i32((num_seqs,)))
    else:
        raise ValueError(f"kernel must be 'ragged' or 'decode', not {kernel!r}")
    args += (i32((num_seqs, width)), i32(()), scales, scales)
    with cuda_target(capability):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# A GPU of each compute capability, as jax names its kind.
GPU_OF_CAPABILITY = {80: "NVIDIA A100", 86: "NVIDIA A10", 89: "NVIDIA L4", 90: "NVIDIA H100"}


def cuda_target(capability: int) -> contextlib.AbstractContextManager:
    """Lowering for a GPU that is not here: jax 0.11's Triton lowering reads the target from
    an abstract device (0.10 assumed sm_90 without a GPU, and ignores this)."""
    device = jax.sharding.AbstractDevice(
        device_kind=GPU_OF_CAPABILITY[capability], num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("target",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def compile_kernel(kernel: str, capability: int = 90, **shapes) -> CompiledKernel:
    """`lower_for_cuda(kernel, capability=capability, **shapes)`, compiled for that SM."""
    [triton_kernel] = triton_kernels(lower_for_cuda(kernel, capability=capability, **shapes))
    return compile_for_sm(triton_kernel, capability)


def main() -> None:
    # Imported here: tests import this module as `benchmarks.triton_compile` too.
    from report import add_smoke_flag, report, skip

    parser = argparse.ArgumentParser(
        description="Compiles the kernels for one SM; prints their resource use."
    )
    parser.add_argument("--kernels", default="ragged,decode")
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--kv-dtype", default="bfloat16")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at the smallest head; flags still win
        parser.set_defaults(head_dim=64, group=2)
    args = parser.parse_args()
    if args.smoke and (missing := missing_requirement()):
        skip(f"needs {missing}")
    import triton

    result: dict[str, Any] = {"triton": triton.__version__}
    for kernel in args.kernels.split(","):
        compiled = compile_kernel(
            kernel,
            args.capability,
            kv_dtype=jnp.dtype(args.kv_dtype),
            head_dim=args.head_dim,
            group=args.group,
        )
        for key, value in dataclasses.asdict(compiled).items():
            result[f"{kernel}_{key}"] = value
        result[f"{kernel}_blocks_per_sm"] = compiled.blocks_per_sm
    report("triton_compile", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
