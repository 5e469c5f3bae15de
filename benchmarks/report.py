"""Shared output of the benchmark scripts: an aligned table on stdout, JSON under results/."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def report(name: str, result: dict) -> None:
    """Prints `result` as `key  value` rows and writes it to results/{name}.json."""
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
