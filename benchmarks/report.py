"""Shared output of the benchmark scripts: an aligned table on stdout, JSON under results/.

Every script takes `--smoke` (`add_smoke_flag`): a run of seconds on a tiny workload, so that
tests/test_benchmarks.py runs them all and none rots between measurements. A smoke run's numbers
mean nothing, so its files go to a temporary folder (`results_dir`), never to results/.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# Where smoke runs write (the test's temporary folder); unset: a new temporary folder.
SMOKE_RESULTS_ENV = "PAGEDJAX_BENCH_RESULTS"
# A smoke run that cannot run here (no GPU, no llama.cpp) exits with this code after saying why;
# 77 is the skip code of automake's test harness.
SKIP_EXIT = 77


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds on a tiny workload, to check the script runs; its numbers mean nothing "
        "and its files go to a temporary folder",
    )


def results_dir(smoke: bool = False) -> Path:
    """results/, or for a smoke run $PAGEDJAX_BENCH_RESULTS (else a new temporary folder)."""
    if smoke:
        chosen = os.environ.get(SMOKE_RESULTS_ENV)
        path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="pagedjax-smoke-"))
    else:
        path = RESULTS
    path.mkdir(parents=True, exist_ok=True)
    return path


def report(name: str, result: dict, smoke: bool = False) -> Path:
    """Prints `result` as `key  value` rows and writes it to {results_dir}/{name}.json."""
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    path = results_dir(smoke) / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def skip(reason: str) -> None:
    """Ends a smoke run that needs what this machine lacks: prints why, exits with SKIP_EXIT."""
    print(f"skipped: {reason}", flush=True)
    raise SystemExit(SKIP_EXIT)
