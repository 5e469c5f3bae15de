"""A C++ CPU kernel as it was at a git revision, compiled and registered beside today's, so a
benchmark times both in one process (`quantized_matmul.py`, `cpu_attention.py`).

    register_baseline(rev, "packed_matmul.cc", "QuantizedMatmul", "my_baseline_target")
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from pagedjax.cpu_native import build

ROOT = Path(__file__).resolve().parent.parent
CSRC = "pagedjax/cpu_native/csrc"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def register_baseline(rev: str, source: str, symbol: str, target: str) -> None:
    """Compiles `source` (a file of csrc/, with every header there) as it is at `rev`, like the
    engine's kernels at this machine's best level, and registers its FFI handler `symbol` as
    the CPU target `target`."""
    with tempfile.TemporaryDirectory(prefix="kernel_baseline_") as directory:
        tmp = Path(directory)
        headers = [Path(p).name for p in _git("ls-tree", "--name-only", rev, f"{CSRC}/").split()]
        for name in [source, *(h for h in headers if h.endswith(".h"))]:
            (tmp / name).write_text(_git("show", f"{rev}:{CSRC}/{name}"))
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        library = tmp / "baseline.so"
        subprocess.run(
            [compiler, "-O3", *build.level_flags(build.levels()[0]), "-fopenmp-simd",
             "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
             str(tmp / source), "-o", str(library)],
            check=True,
        )  # fmt: skip
        handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)  # stays loaded
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
