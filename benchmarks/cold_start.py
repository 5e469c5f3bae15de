"""Cold start: wall seconds from process start to exit of `pagedjax generate PROMPT --max-tokens 1`
(load, compile, one token), without JAX's persistent compilation cache, then twice with it
enabled through environment variables (the first run fills an empty cache directory, the second
reads it); medians of --repeats runs of each kind. The console script is run from the
interpreter's own bin directory when it is there, so a version manager's shim (pyenv) is not
timed.

    python benchmarks/cold_start.py [--prompt "..."] [--repeats 3] [--smoke (one run of each)]

Writes results/cold_start.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import add_smoke_flag, report  # (benchmarks/ is the script directory)


def command(prompt: str) -> list[str]:
    script = Path(sys.executable).parent / "pagedjax"
    cli = str(script) if script.is_file() else shutil.which("pagedjax")
    base = [cli] if cli else [sys.executable, "-m", "pagedjax.cli"]
    return [*base, "generate", prompt, "--max-tokens", "1"]


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", default="Why is the sky blue?")
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each kind (median; default 3)"
    )
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 3)

    cmd = command(args.prompt)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    result = {"command": shlex.join(cmd)}
    result["no_cache_s"] = statistics.median(timed(cmd, env) for _ in range(args.repeats))
    first, second = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="jax_cache_") as cache:
            cached_env = {
                **env,
                "JAX_COMPILATION_CACHE_DIR": cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            }
            first.append(timed(cmd, cached_env))
            entries = len(os.listdir(cache))
            second.append(timed(cmd, cached_env))
    result["cache_first_run_s (fills it)"] = statistics.median(first)
    result["cache_entries_written"] = entries
    result["cache_second_run_s"] = statistics.median(second)
    result["second_vs_no_cache"] = result["no_cache_s"] / result["cache_second_run_s"]
    report("cold_start", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
