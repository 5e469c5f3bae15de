"""Builds and registers the C++ kernels for XLA:CPU (`csrc/*.cc`), called through the XLA FFI.

The sources are compiled together with the system C++ compiler on first use, against the FFI
headers that jaxlib ships, into one library per instruction-set level in a cache directory keyed
by the sources, the level's flags and the jax version, so each build runs once per machine.

Levels (x86-64, best first): `avx512` (AVX-512 F/BW/CD/DQ/VL and VNNI), `avx2` (AVX2, FMA, F16C: the
fallback every x86-64 machine of the last decade has) and `generic` (the portable loops). The
best level the CPU and the OS both offer is chosen once per process (`isa()`, from the kernel's
`/proc/cpuinfo` flags, which leave out what the OS does not enable); `PAGEDJAX_CPU_ISA` forces a
lower one, so one machine tests every path. Other architectures build one `native` level. Each
level registers its own FFI targets (`<target>_<level>`), so tests and benchmarks call several
side by side. If no compiler is found or the build fails, `available()` is False and a warning
says why: the CPU platform then runs XLA instead (`pagedjax/platforms/cpu.py`).
`PAGEDJAX_DISABLE_CPU_KERNEL=1` does the same on purpose.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cc"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# FFI target name -> the handler symbol the sources export.
TARGETS = {
    "pagedjax_paged_attention": "PagedAttention",
    "pagedjax_kv_write": "KvWrite",
    "pagedjax_packed_matmul": "PackedMatmul",
    "pagedjax_quantized_matmul": "QuantizedMatmul",
    "pagedjax_int8_matmul": "Int8Matmul",
    "pagedjax_grouped_packed_matmul": "GroupedPackedMatmul",
    "pagedjax_greedy_sample": "GreedySample",
    "pagedjax_token_logprobs": "TokenLogprobs",
    "pagedjax_random_sample": "RandomSample",
}
ISA_ENV = "PAGEDJAX_CPU_ISA"
# x86-64 levels, best first: (compiler flags, the /proc/cpuinfo flags a machine needs).
X86_LEVELS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512": (
        ("-march=x86-64-v4", "-mavx512vnni"),
        frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni"}),
    ),
    "avx2": (("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"})),
    "generic": (("-march=x86-64",), frozenset()),
}
NATIVE = "native"  # the one level elsewhere: whatever the compiler finds on this machine


def _cpu_flags() -> frozenset[str] | None:
    """The CPU flags Linux reports (those the OS has enabled), or None where it cannot tell."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def levels() -> list[str]:
    """The levels this machine runs, best first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [NATIVE]
    flags = _cpu_flags()
    if flags is None:  # no way to tell what the OS enables: the portable build only
        return ["generic"]
    return [name for name, (_, needs) in X86_LEVELS.items() if needs <= flags]


@functools.cache
def isa() -> str:
    """The level this process's kernels run: the best this machine runs, or `PAGEDJAX_CPU_ISA`."""
    supported = levels()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return supported[0]
    if forced not in supported:
        known = [*X86_LEVELS, NATIVE]
        what = "runs" if forced in known else f"is one of {known}; this machine runs"
        raise ValueError(
            f"{ISA_ENV}={forced!r}: the level must be one this machine runs ({what} "
            f"{supported}); unset it to use the best"
        )
    return forced


def level_flags(level: str) -> tuple[str, ...]:
    """The compiler flags a level's kernels are built with."""
    return ("-march=native",) if level == NATIVE else (*X86_LEVELS[level][0], "-mtune=native")


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedjax"
    )
    return Path(root)


def _run(commands: list[list[str]]) -> None:
    """Runs the commands side by side (one compiler per source: the build takes the longest
    source's time); raises with the first failure's errors."""
    jobs = [(command, subprocess.Popen(command, stderr=subprocess.PIPE, text=True))
            for command in commands]  # fmt: skip
    for command, job in jobs:
        _, errors = job.communicate()
        if job.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{errors[-2000:]}")


def _build(level: str) -> Path:
    flags = level_flags(level)
    key = hashlib.sha256(jax.__version__.encode() + jax.lib.__version__.encode())
    key.update(" ".join(flags).encode())
    for source in SOURCES + HEADERS:
        key.update(source.name.encode() + source.read_bytes())
    library = _cache_dir() / f"cpu_kernels-{level}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    compile_flags = [
        "-O3", *flags, "-fopenmp-simd", "-std=c++17", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        _run([
            [compiler, *compile_flags, "-c", str(source), "-o", obj]
            for source, obj in zip(SOURCES, objects, strict=True)
        ])  # fmt: skip
        built = str(Path(tmp) / library.name)
        _run([[compiler, "-shared", *objects, "-o", built]])
        os.replace(built, library)  # atomic: concurrent builds leave one complete file
    return library


@functools.cache
def load(level: str) -> bool:
    """Builds (once) and registers one level's kernels; False, with a warning, if that fails."""
    if level not in levels():
        raise ValueError(f"this machine does not run the {level!r} kernels (it runs {levels()})")
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(level)))
        for target, symbol in TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(f"{target}_{level}", capsule, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as error:
        warnings.warn(f"C++ CPU kernels unavailable, using XLA instead: {error}", stacklevel=2)
        return False
    return True


def available() -> bool:
    """Whether this process's level (`isa()`) is built and registered: it is, once, if it can."""
    return not os.environ.get("PAGEDJAX_DISABLE_CPU_KERNEL") and load(isa())


def ffi_call(
    target: str, result_shape_dtypes, *, level: str | None = None, **options
) -> Callable[..., Any]:
    """`jax.ffi.ffi_call` of one of these kernels at `level` (default: `isa()`), built and
    registered first (`options`: ffi_call's keywords, such as input_output_aliases)."""
    level = level or isa()
    if os.environ.get("PAGEDJAX_DISABLE_CPU_KERNEL") or not load(level):
        raise RuntimeError(
            f"the C++ CPU kernel {target} is not available here (see the warning above); "
            "run on the CPU platform's XLA path instead"
        )
    return jax.ffi.ffi_call(f"{target}_{level}", result_shape_dtypes, **options)
