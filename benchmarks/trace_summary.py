"""A `jax.profiler` trace of engine steps summarised into numbers: how many device ops (kernels
on a GPU, XLA thunks on a CPU) a step runs, how long the device is busy and idle, and the gaps
between its bursts of work (issue 41: the card should never wait for the host).

    with step_trace(folder) as mark:      # a trace of the steps run inside
        for _ in range(steps):
            with mark():                  # one engine step, named on the host's timeline
                engine.step()
    summary = summarise(load_trace(folder), steps)

The device's ops are a GPU's events on its CUDA streams' lanes when the trace has a GPU, else
(XLA:CPU) the events XLA names by their HLO op (`args.hlo_op`), wherever they ran.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

STEP = "pagedjax.step"  # the host-side name of one traced engine step


@contextmanager
def step_trace(folder: Path) -> Iterator[Callable[[], AbstractContextManager]]:
    """Traces what runs inside into `folder`; yields a function whose context marks a step."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # an event per Python call would slow the host it measures
    jax.profiler.start_trace(str(folder), create_perfetto_trace=True, profiler_options=options)
    try:
        yield lambda: jax.profiler.TraceAnnotation(STEP)
    finally:
        jax.profiler.stop_trace()


def load_trace(folder: Path) -> list[dict]:
    """The trace events of the Chrome-format trace under `folder` (the Perfetto one that
    `step_trace` asks for, else the profiler's own)."""
    files = [*Path(folder).rglob("perfetto_trace.json.gz"), *Path(folder).rglob("*.trace.json.gz")]
    if not files:
        raise FileNotFoundError(f"no trace under {folder}")
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) intervals merged, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def device_ops(events: list[dict]) -> list[dict]:
    """The complete events of the device's ops. On a GPU: its CUDA streams' lanes (kernels and
    copies; the profiler's derived lanes, such as "XLA Ops", repeat them), or every GPU lane
    if none is named a stream. On a CPU: XLA's thunks, the events named by their HLO op."""
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    gpu = {pid for pid, name in process.items() if "GPU" in name}
    complete = [e for e in events if e.get("ph") == "X"]
    if not gpu:
        return [e for e in complete if "hlo_op" in e.get("args", {})]
    lanes = {
        (e["pid"], e.get("tid"))
        for e in events
        if e.get("name") == "thread_name" and e["pid"] in gpu and "Stream" in e["args"]["name"]
    }
    on_gpu = [e for e in complete if e["pid"] in gpu]
    return [e for e in on_gpu if (e["pid"], e.get("tid")) in lanes] if lanes else on_gpu


def summarise(events: list[dict], num_steps: int) -> dict:
    """Per step of the model (num_steps: forwards of every running row; times in ms): the
    device's ops, its busy and idle time between its first op and its last; the host's time
    per marked engine step (median), and the gaps between those steps, taken as the longest
    idle spans, one fewer than the marked steps (num_steps without marks); `modules`: each
    jitted function's ops and busy time per step."""
    ops = device_ops(events)
    if not ops or num_steps < 1:
        raise ValueError("the trace has no device ops (was anything run inside it?)")
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in ops])
    gaps = sorted((b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)), reverse=True)
    hosts = [e["dur"] for e in events if e.get("ph") == "X" and e.get("name") == STEP]
    step_gaps = gaps[: (len(hosts) or num_steps) - 1] or [0.0]
    busy_us = sum(end - start for start, end in busy)
    window_us = busy[-1][1] - busy[0][0]
    modules: dict[str, dict] = {}
    for e in ops:
        module = modules.setdefault(e["args"].get("hlo_module", "?"), {"ops": 0, "us": 0.0})
        module["ops"] += 1
        module["us"] += e["dur"]
    return {
        "steps": num_steps,
        "marked_steps": len(hosts),
        "device_ops_per_step": len(ops) / num_steps,
        "device_busy_ms_per_step": busy_us / num_steps / 1e3,
        "device_idle_ms_per_step": (window_us - busy_us) / num_steps / 1e3,
        "device_idle_share": 1 - busy_us / window_us if window_us else 0.0,
        "step_gap_ms_median": statistics.median(step_gaps) / 1e3,
        "step_gap_ms_max": step_gaps[0] / 1e3,
        "host_ms_per_step_median": statistics.median(hosts) / 1e3 if hosts else None,
        "modules": {
            name: {
                "ops_per_step": m["ops"] / num_steps,
                "ms_per_step": m["us"] / num_steps / 1e3,
            }
            for name, m in sorted(modules.items(), key=lambda item: -item[1]["us"])
        },
    }
