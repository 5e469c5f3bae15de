"""Host-side cost of engine steps with many running requests: scheduling, block management,
input preparation, sampling metadata, detokenization, stop checks and outputs.

    python benchmarks/host_overhead.py [--running 256] [--steps 30]
    python benchmarks/host_overhead.py --host-only [--running 256] [--steps 100]
    python benchmarks/host_overhead.py --overlap [--running 64] [--steps 30]
    python benchmarks/host_overhead.py --transfers [--running 256] [--steps 2000]
    python benchmarks/host_overhead.py --arrivals [--running 64] [--rates 0.1,0.5] [--sampled]
    python benchmarks/host_overhead.py --generate [--running 256] [--steps 128] [--multi-step 8]
    ... [--model DIR]   another model than the default one
    python benchmarks/host_overhead.py --smoke   every mode, 4 requests, 3 steps, a tiny model

Default: the real model on this machine's device; the waiting is the time blocked on the step's
device results (the only host sync of a step), timed around a block_until_ready on the
sampler's outputs right after dispatch; host time is the rest of each engine.step(). (cProfile,
used before, adds about 1 us per Python call and so overstates host time at 256 rows.)

--host-only: the forward and the sampler are replaced by stubs that return at once (random
tokens), so a step is the engine's host work alone: microseconds of CPU time per step, the
number that bounds a GPU's steps per second. Measured for the two output kinds that matter:
CUMULATIVE (every running request gets an output each step, as `LLMEngine.step` callers
stream) and FINAL_ONLY (what `LLM.generate` asks for), with one decode step per dispatch and
--multi-step of them (then also per token-step). "core" is the engine core's part of a step
(schedule, dispatch, update) plus packing its outputs for another process: what a step costs
an engine core in a process of its own (`pagedjax serve`), the front end detokenizing beside it.
"final_only_greedy": FINAL_ONLY greedy requests without a stop string (K = 1). The K = 1
runs are repeated with steady decode steps off (`_general`: each step scheduled request by
request), the peer in the same run. Each run also reports its phases' medians
(`time_phases`): schedule, dispatch (of which input preparation and the sampling arrays),
update, outputs.

--overlap: the same decode steps (CUMULATIVE outputs, as a server streams) with async
scheduling off and on, one engine after the other in the same run: steps/s of each and the
ratio. With it on, step N+1's host work runs while step N is on the device.

--transfers: a steady decode step's host arrays sent packed (as the engine does) against one
jit argument each (as it did), in the same run: µs per call, waited on.

--arrivals: steady decode steps while requests come and go (`arrivals`), the device stubbed as
for --host-only: at each arrival rate the share of steps that were steady (with and without
prefills beside the batch's rows), the host's CPU µs per step, and the queue at the end; the
peer: the same with steady decode steps off.

--generate: what a user sees, `LLM.generate` of --running prompts of 16-64 random tokens x
--steps greedy tokens (ignore_eos, max_num_seqs = --running) on a model whose device work is
small (unless --model: 1 layer, hidden 64, a 2,048-word vocabulary); the second call is
timed, with async scheduling off and on, one decode step per dispatch and --multi-step
(num_scheduler_steps) of them: ms per dispatched step, ms per token-step (a forward pass of
every running row), and of that the host's share (the time not blocked on the device's
results; on a CPU the device's work shares the cores with it). --core-process: also with
the engine core in a process of its own (`LLM(core_process=True)`, async scheduling on),
this process detokenizing and building outputs; its host share is the core's. The peer:
K = 1, async on, with steady decode steps off (`_general`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, make_prompts, save_random_llama  # noqa: E402


def start_requests(llm, running: int, max_tokens: int, greedy: bool = False, **params) -> None:
    """Adds `running` seeded top-p requests with a stop string (a per-row host path, not greedy
    only; `greedy`: greedy ones without, as `LLM.generate` users often ask) and steps until
    every one is prefilled and has sampled a token."""
    from pagedjax.sampling_params import SamplingParams

    engine = llm.llm_engine
    sampled = dict(temperature=0.8, top_p=0.9, stop=["\n\n\n"])
    for i, prompt in enumerate(make_prompts(llm.get_tokenizer(), running)):
        sampling = SamplingParams(
            **(dict(temperature=0.0) if greedy else sampled),
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=True,
            **params,
        )
        engine.add_request(str(i), prompt, sampling)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()


def make_llm(running: int, model: str | None, max_num_batched_tokens: int = 512, **options):
    from pagedjax.llm import LLM

    return LLM(
        model,
        max_model_len=512,
        max_num_batched_tokens=max(max_num_batched_tokens, running),
        max_num_seqs=running,
        num_kv_blocks=kv_blocks(running, 384),
        **options,
    )


def on_device(args) -> None:
    import jax

    from pagedjax.worker import model_runner

    # Smoke: a small token budget, so few token buckets for warmup() to compile and run.
    llm = make_llm(args.running, args.model, 64 if args.smoke else 512)
    engine = llm.llm_engine
    engine.engine_core.worker.runner.warmup()
    # At most what max_model_len leaves after W1's longest prompt (200 tokens).
    start_requests(llm, args.running, min(10_000 // args.running + args.steps + 64, 512 - 200))
    for _ in range(3):  # compiles the sampler's variant for these rows
        engine.step()

    waits = []
    dispatch_sample = model_runner.sample_step

    def sample_and_wait(*args, **kwargs):
        out = dispatch_sample(*args, **kwargs)
        start = time.perf_counter()
        jax.block_until_ready(out)  # the forward and the sampler, dispatched before this
        waits.append(time.perf_counter() - start)
        return out

    model_runner.sample_step = sample_and_wait
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    model_runner.sample_step = dispatch_sample
    waiting = sum(waits)
    running = len(engine.engine_core.scheduler.running)
    report(
        "host_overhead",
        {
            "running_requests": running,
            "steps": args.steps,
            "step_ms_mean": 1000 * total / args.steps,
            "device_wait_ms_per_step": 1000 * waiting / args.steps,
            "host_ms_per_step": 1000 * (total - waiting) / args.steps,
            "host_share": (total - waiting) / total,
        },
        smoke=args.smoke,
    )


def _phase_parts(engine) -> list[tuple[object, str, str]]:
    """(owner, method, phase) of each timed part of a step."""
    core = engine.engine_core
    runner = core.worker.runner
    return [
        (core.scheduler, "schedule", "schedule"),
        (core.worker, "execute_model", "dispatch"),
        (runner, "prepare", "dispatch_prepare"),
        (runner, "prepare_decode", "dispatch_prepare"),  # a steady step's
        (runner, "_sample", "dispatch_sample"),
        (core.scheduler, "update_from_output", "update"),
        (engine.output_processor, "process_outputs", "outputs"),
    ]


def time_phases(engine) -> dict[str, list[float]]:
    """Times each part of the engine's steps from now on (CPU seconds, per step): the
    scheduler, the worker's dispatch (input preparation and sampling arrays within it), the
    scheduler's update from the results, and the output processor."""
    phases: dict[str, list[float]] = {}
    for owner, attribute, phase in _phase_parts(engine):
        function, times = getattr(owner, attribute), phases.setdefault(phase, [])

        def timed(*args, function=function, times=times, **kwargs):
            start = time.thread_time()
            value = function(*args, **kwargs)
            times.append(time.thread_time() - start)
            return value

        setattr(owner, attribute, timed)
    return phases


def untime_phases(engine) -> None:
    """Takes `time_phases`' wrappers off: the engine's memory (its KV pool) is then freed as
    soon as it is dropped, not left to the cycle collector, which kept the pools alive."""
    for owner, attribute, _ in _phase_parts(engine):
        owner.__dict__.pop(attribute, None)


class NoForward:
    """forward_step's stub for --host-only: the step's inputs are packed as for a real one."""

    def __call__(self, params, packed, previous, kv_cache, **options):
        return None, kv_cache, None  # no logits; the draw counters (the sampler's stub ignores)

    def _cache_size(self) -> int:
        return 0


def host_only_runs(multi_step: int, smoke: bool = False) -> list[tuple]:
    """(decode steps per dispatch, output kind, greedy, steady decode steps) of each
    --host-only run (`smoke`: three, each of the script's paths once: a sampled and a greedy
    run, one decode step a dispatch and several, steady and the general way)."""
    from pagedjax.sampling_params import RequestOutputKind

    kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
    counts = sorted({1, multi_step})
    runs = [(k, kind, False, True) for k in counts for kind in kinds]
    runs += [(k, RequestOutputKind.FINAL_ONLY, True, True) for k in counts]  # greedy, no stop
    # The peers: the same steps scheduled the general way, request by request.
    peers = [(k, kind, greedy, False) for k, kind, greedy, _ in runs]
    if smoke:
        return [runs[0], runs[-1], peers[0]]
    return runs + peers


class DeviceStubs:
    """The forward, the sampler and the loop of decode steps replaced by stubs that return at
    once, with random tokens of ordinary text (no newline, so a stop string never ends a
    request): a step is then the engine's host work alone. Installed on entry (after the
    engine's start-up, which runs a real step on a GPU), taken out on exit."""

    def __init__(self, llm) -> None:
        import numpy as np

        decode = llm.get_tokenizer().decode
        vocab_size = llm.llm_engine.model_config.vocab_size  # a small model's is under 40000
        self.words = np.array(
            [i for i in range(1000, min(40000, vocab_size)) if "\n" not in decode([i])]
        )
        self.rng = np.random.default_rng(0)

    def sample_step(self, logits, meta, *args, **options):
        """sample_step's stub: random tokens (and no placeholders: the forward is a stub)."""
        import types

        import numpy as np

        rows = meta.num_rows
        tokens = self.rng.choice(self.words, rows).astype(np.int32)
        finite = np.ones(rows, bool)
        out = types.SimpleNamespace(token_ids=tokens, finite=finite, logprobs=None, accepted=None)
        return out, None

    def __enter__(self) -> DeviceStubs:
        from pagedjax.worker import model_runner

        self.real = model_runner.sample_step, model_runner.decode_steps, model_runner.forward_step
        model_runner.sample_step, model_runner.decode_steps = self.sample_step, RandomSteps(self)
        model_runner.forward_step = NoForward()
        return self

    def __exit__(self, *exc) -> None:
        from pagedjax.worker import model_runner

        model_runner.sample_step, model_runner.decode_steps, model_runner.forward_step = self.real


class RandomSteps:
    """decode_steps' stub: [num_steps, rows] random tokens."""

    def __init__(self, stubs: DeviceStubs) -> None:
        self.stubs = stubs

    def __call__(self, params, packed, previous, kv_cache, meta, num_steps: int, **options):
        import numpy as np

        rows = meta.num_rows  # the logits rows
        tokens = self.stubs.rng.choice(self.stubs.words, (num_steps, rows)).astype(np.int32)
        return tokens, np.ones((num_steps, rows), bool), None, kv_cache, None

    def _cache_size(self) -> int:
        return 0


def host_only(args) -> None:
    from pagedjax.engine_core_proc import pack_outputs

    stubs = None
    # Outputs of ~40 tokens on prompts of 25-200, as mid-generation.
    warm_steps = 2 if args.smoke else 30
    result = {"running_requests": args.running, "steps": args.steps}
    for num_steps, kind, greedy, steady in host_only_runs(args.multi_step, args.smoke):
        # A large budget prefills everyone in a few steps, so all requests start level and
        # run to the end of the measured steps within 384 tokens.
        llm = make_llm(
            args.running, args.model, max_num_batched_tokens=8192, num_scheduler_steps=num_steps
        )
        engine = llm.llm_engine
        engine.engine_core.scheduler.steady_decode = steady
        stubs = stubs or DeviceStubs(llm)
        stubs.__enter__()
        engine.engine_core.worker.runner.prefetch_results = False  # the stubs hand back numpy
        # As many tokens per row as one step per dispatch: fewer dispatches of several.
        warm, steps = max(1, warm_steps // num_steps), max(1, args.steps // num_steps)
        start_requests(llm, args.running, warm_steps + args.steps + 16, greedy, output_kind=kind)
        for _ in range(warm):
            engine.step()
        core = engine.engine_core
        core_step, core_times = core.step, []

        def timed_core_step(core_step=core_step, core_times=core_times):
            """The engine core's part (schedule, dispatch, update) and the packing of its
            outputs for another process: a step's cost to a core in a process of its own."""
            start = time.thread_time()
            outputs = core_step()
            pack_outputs(outputs)
            core_times.append(time.thread_time() - start)
            return outputs

        core.step = timed_core_step
        phases = time_phases(engine)
        cpu_times, token_steps = [], core.num_model_steps
        for _ in range(steps):
            start = time.thread_time()  # CPU time: steadier than wall time on a shared VM
            engine.step()
            cpu_times.append(time.thread_time() - start)
        token_steps = (core.num_model_steps - token_steps) / steps  # per dispatch
        assert len(core.scheduler.running) == args.running, "a request ended early"
        assert core.scheduler.num_preemptions == 0
        name = kind.name.lower() if num_steps == 1 else f"k{num_steps}_{kind.name.lower()}"
        name += "_greedy" if greedy else ""
        name += "" if steady else "_general"
        median = statistics.median(cpu_times)
        for phase, times in phases.items():
            if not times:  # a part the run never takes (K > 1 samples in its loop)
                continue
            result[f"{name}_{phase}_us_median"] = 1e6 * statistics.median(times)
        result[f"{name}_us_per_step_median"] = 1e6 * median
        result[f"{name}_us_per_step_mean"] = 1e6 * statistics.fmean(cpu_times)
        result[f"{name}_us_per_row_median"] = 1e6 * median / args.running
        result[f"{name}_core_us_per_step_median"] = 1e6 * statistics.median(core_times)
        if num_steps > 1:
            result[f"{name}_token_steps_per_step"] = token_steps
            result[f"{name}_us_per_token_step_median"] = 1e6 * median / token_steps
            core_median = statistics.median(core_times)
            result[f"{name}_core_us_per_token_step_median"] = 1e6 * core_median / token_steps
        stubs.__exit__()
        untime_phases(engine)
        del core.step, llm, engine, core
    report("host_overhead_host_only", result, smoke=args.smoke)


def overlap(args) -> None:
    from pagedjax.sampling_params import RequestOutputKind

    result = {"running_requests": args.running, "steps": args.steps}
    for mode in ("off", "on"):
        batched_tokens = 64 if args.smoke else 512  # as in on_device
        llm = make_llm(args.running, args.model, batched_tokens, async_scheduling=mode == "on")
        engine = llm.llm_engine
        engine.engine_core.worker.runner.warmup()
        max_tokens = args.steps + 64
        start_requests(llm, args.running, max_tokens, output_kind=RequestOutputKind.CUMULATIVE)
        for _ in range(3):  # compiles the sampler's variant for these rows
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        # A sampled stop string may end a request; both modes sample the same tokens.
        result[f"async_{mode}_running_at_end"] = len(engine.engine_core.scheduler.running)
        result[f"async_{mode}_steps_per_s"] = 1 / statistics.median(times)
        result[f"async_{mode}_step_ms_median"] = 1000 * statistics.median(times)
        del llm, engine
    result["ratio_on_vs_off"] = result["async_on_steps_per_s"] / result["async_off_steps_per_s"]
    report("host_overhead_overlap", result, smoke=args.smoke)


def generate_steps(args) -> None:
    import random

    from pagedjax.sampling_params import SamplingParams

    rng = random.Random(0)
    result = {"running_requests": args.running, "tokens": args.steps}
    asyncs = ("on",) if args.async_only else ("off", "on")
    modes = [(k, a, False, True) for k in sorted({1, args.multi_step}) for a in asyncs]
    if args.core_process:  # the core in a process of its own, async scheduling on
        modes += [(k, "on", True, True) for k in sorted({1, args.multi_step})]
    if not (args.no_peer or args.smoke):  # K = 1 steps scheduled the general way
        modes.append((1, "on", False, False))
    for num_steps, mode, core_process, steady in modes:
        llm = make_llm(
            args.running,
            args.model,
            async_scheduling=mode == "on",
            num_scheduler_steps=num_steps,
            core_process=core_process,
        )
        if not steady:
            llm.llm_engine.engine_core.scheduler.steady_decode = False
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]}
            for _ in range(args.running)
        ]
        params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # compiles every shape the run takes
        engine = llm.llm_engine
        counters = ("num_steps", "num_model_steps", "device_wait_s")
        before = [engine.stats()[key] for key in counters]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = [engine.stats()[key] for key in counters]
        steps, model_steps, waited = (now - then for now, then in zip(after, before, strict=True))
        name = f"k{num_steps}_async_{mode}" + ("_core_process" if core_process else "")
        name += "" if steady else "_general"
        result[f"{name}_steps"] = steps
        result[f"{name}_token_steps"] = model_steps
        result[f"{name}_ms_per_step"] = 1000 * seconds / steps
        result[f"{name}_ms_per_token_step"] = 1000 * seconds / model_steps
        result[f"{name}_host_ms_per_token_step"] = 1000 * (seconds - waited) / model_steps
        result[f"{name}_output_tokens_per_s"] = args.running * args.steps / seconds
        if args.trace and not core_process:
            try:
                traced = trace_generate(llm, prompts, params)
            except Exception as error:  # a profiler that cannot start: the timings still count
                traced = {"error": repr(error)[:300]}
            result |= {f"{name}_trace_{key}": value for key, value in traced.items()}
        llm.llm_engine.shutdown()
        del llm, engine
    report("host_overhead_generate", result, smoke=args.smoke)


def arrivals(args) -> None:
    """Steady decode steps while requests come and go: --running slots, as many requests at
    the start, then each step one more with the chance each of --rates gives; every request
    16-64 random prompt tokens x 50-300 tokens (greedy, or seeded top-p with --sampled;
    ignore_eos; FINAL_ONLY as `LLM.generate` asks: the output processor's per-row work left
    out), the device stubbed (`DeviceStubs`: the host's work alone). Over --steps engine
    steps after a warm-up, with steady decode steps on and off (`_general`, the peer, in the
    same run): the shares of the steps that ran that were steady (only the batch's rows) and
    steady with sequences beside the rows (prefills of requests admitted), the host's CPU µs
    per step (median and mean: a step that admits costs more), and the requests waiting at
    the end (a queue: every slot taken, each finish admits one)."""
    import random

    from pagedjax.sampling_params import RequestOutputKind, SamplingParams

    result = {"running_requests": args.running, "steps": args.steps, "sampled": args.sampled}
    rates = args.rates.split(",")[-1:] if args.smoke else args.rates.split(",")
    for rate in map(float, rates):
        for steady in (True,) if args.smoke else (True, False):  # smoke: the path, not a peer
            llm = make_llm(args.running, args.model)
            engine = llm.llm_engine
            scheduler = engine.engine_core.scheduler
            scheduler.steady_decode = steady
            kinds, schedule = [], scheduler.schedule

            def counted(schedule=schedule, kinds=kinds):
                out = schedule()
                if out.scheduled:  # a step that runs: 0 general, 1 steady, 2 with prefills
                    kinds.append(0 if out.decode is None else 1 + bool(out.seqs))
                return out

            scheduler.schedule = counted
            rng, vocab = random.Random(0), engine.model_config.vocab_size

            def arrive(index: int, rng=rng, vocab=vocab, engine=engine, sampled=args.sampled):
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
                greedy = dict(temperature=0.0)
                sampling = dict(temperature=0.8, top_p=0.9, seed=index) if sampled else greedy
                params = SamplingParams(
                    **sampling,
                    max_tokens=rng.randint(50, 300),
                    ignore_eos=True,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                engine.add_request(f"a{index}", {"prompt_token_ids": prompt}, params)

            with DeviceStubs(llm):
                engine.engine_core.worker.runner.prefetch_results = False  # numpy from stubs
                for index in range(args.running):
                    arrive(index)
                warm, cpu_times, by_kind = (2 if args.smoke else 50), [], {}
                for step in range(warm + args.steps):
                    if rng.random() < rate:
                        arrive(args.running + step)
                    if step == warm:
                        del kinds[:]
                    ran, start = len(kinds), time.thread_time()
                    engine.step()
                    if step >= warm:
                        cpu_times.append(time.thread_time() - start)
                        if len(kinds) > ran:  # the step's own time, by the way it was scheduled
                            by_kind.setdefault(kinds[-1], []).append(cpu_times[-1])
            name = f"rate_{rate:g}" + ("" if steady else "_general")
            result[f"{name}_steady_share"] = kinds.count(1) / max(len(kinds), 1)
            result[f"{name}_beside_share"] = kinds.count(2) / max(len(kinds), 1)
            result[f"{name}_us_per_step_median"] = 1e6 * statistics.median(cpu_times)
            result[f"{name}_us_per_step_mean"] = 1e6 * statistics.fmean(cpu_times)
            for kind, times in sorted(by_kind.items()):
                label = ("general", "steady", "beside")[kind]
                result[f"{name}_{label}_us_median"] = 1e6 * statistics.median(times)
            result[f"{name}_waiting_at_end"] = len(scheduler.waiting)
            engine.shutdown()
            del llm, engine, scheduler
    for rate in map(float, [] if args.smoke else rates):
        name = f"rate_{rate:g}"
        ratio = result[f"{name}_general_us_per_step_mean"] / result[f"{name}_us_per_step_mean"]
        result[f"{name}_general_over_steady_mean"] = ratio
        print(f"rate {rate:g}: general/steady host time per step (mean) {ratio:.2f}x")
    name = "host_overhead_arrivals" + ("_sampled" if args.sampled else "")
    report(name, result, smoke=args.smoke)


def trace_generate(llm, prompts: list, params) -> dict:
    """`LLM.generate` once more, under a `jax.profiler` trace with each engine step marked:
    the summary of its decode steps (`trace_summary.summarise`; the per-module table dropped
    but for its op counts). The trace's own cost slows the host, so the step times above are
    the ones to quote; the device's ops and gaps are what this adds."""
    import tempfile
    from pathlib import Path

    from trace_summary import load_trace, step_trace, summarise

    engine = llm.llm_engine
    step, before = engine.step, engine.stats()["num_model_steps"]
    with tempfile.TemporaryDirectory() as folder:
        with step_trace(Path(folder)) as mark:

            def marked_step():
                with mark():
                    return step()

            engine.step = marked_step
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                engine.step = step
        steps = engine.stats()["num_model_steps"] - before
        summary = summarise(load_trace(Path(folder)), steps)
    modules = summary.pop("modules")
    summary.pop("steps")
    summary |= {f"ops_{name}": m["ops_per_step"] for name, m in list(modules.items())[:4]}
    return summary


def transfers(args) -> None:
    """A decode step's host arrays at --running rows sent as the engine sends them now (the
    forward's inputs and the sampler's draw counters packed into one array) against as they were
    sent before (each array its own jit argument: the forward's ten, the sampler's thirteen),
    in the same run: µs per call of a jitted function that reads every array, waited on."""
    import dataclasses

    import jax
    import numpy as np

    from pagedjax.worker.step_inputs import pack

    llm = make_llm(args.running, args.model, max_num_batched_tokens=8192)
    start_requests(llm, args.running, 64)
    runner = llm.llm_engine.engine_core.worker.runner
    scheduler = llm.llm_engine.engine_core.scheduler
    scheduler.steady_decode = False  # a decode step as the general way hands it: seqs, rows
    step = scheduler.schedule()
    seqs, rows = step.seqs, step.rows
    tokens, positions, metadata, r_pad, copies, sources, _ = runner.prepare(seqs, len(rows), [])
    meta = runner.build_sampling_metadata(rows, r_pad)
    logits_rows = np.zeros(r_pad, np.int32)
    forward_inputs = (tokens, sources, positions, metadata, logits_rows, copies, meta.steps)

    @jax.jit
    def read(*arrays):  # touches every argument, so each is on the device
        return sum(jax.numpy.sum(a.astype(jax.numpy.float32)) for a in arrays)

    def separate():
        return read(*jax.tree.leaves(forward_inputs[:-1]), *jax.tree.leaves(meta))

    kept = jax.device_put(jax.tree.leaves(dataclasses.replace(meta, steps=None)))

    def packed():  # the sampler's arrays are the last step's, the counters in the packed ones
        return read(pack(forward_inputs)[0], *kept)

    result = {"running_requests": args.running}
    for name, call in (("separate", separate), ("packed", packed)):
        call().block_until_ready()
        times = []
        for _ in range(max(args.steps, 3)):
            begin = time.perf_counter()
            call().block_until_ready()
            times.append(time.perf_counter() - begin)
        result[f"{name}_us_median"] = 1e6 * statistics.median(times)
    result["separate_over_packed"] = result["separate_us_median"] / result["packed_us_median"]
    llm.llm_engine.shutdown()
    report("host_overhead_transfers", result, smoke=args.smoke)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=None, help="default 256 (--smoke: 4)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps measured")
    parser.add_argument("--host-only", action="store_true", help="stub the device; CPU us")
    parser.add_argument("--overlap", action="store_true", help="async scheduling off vs on")
    parser.add_argument("--generate", action="store_true", help="LLM.generate's ms per step")
    parser.add_argument(
        "--transfers", action="store_true", help="a step's host arrays packed vs one by one"
    )
    parser.add_argument(
        "--arrivals", action="store_true", help="steady steps and host us under arrivals"
    )
    parser.add_argument(
        "--rates", default="0.02,0.1,0.5", help="--arrivals: requests arriving per step"
    )
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="--arrivals: seeded top-p requests (each row's sampling arrays its own)",
    )
    parser.add_argument(
        "--multi-step",
        type=int,
        default=8,
        help="num_scheduler_steps beside 1 (--generate, --host-only)",
    )
    parser.add_argument(
        "--async-only", action="store_true", help="--generate: only with async scheduling on"
    )
    parser.add_argument(
        "--no-peer",
        action="store_true",
        help="--generate: without the peer (K = 1 with steady decode steps off; --smoke: never)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="--generate: also a profiler trace of each run: device ops per token-step, "
        "the device's idle time and the gaps between steps",
    )
    parser.add_argument(
        "--core-process",
        action="store_true",
        help="--generate: also with the engine core in a process of its own (async on)",
    )
    parser.add_argument(
        "--model", default=None, help="a model directory (default: the default model); on a "
        "GPU e.g. the one `gpu_throughput.py --model-dir DIR --build-only` saves",
    )  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.generate:
        modes = {generate_steps: 128}
    elif args.overlap:
        modes = {overlap: 30}
    elif args.host_only:
        modes = {host_only: 100}
    elif args.transfers:
        modes = {transfers: 2000}
    elif args.arrivals:
        modes = {arrivals: 400}
    elif args.smoke:  # every mode, so that none rots
        modes = {on_device: 30, host_only: 100, overlap: 30, generate_steps: 128, transfers: 3}
        modes[arrivals] = 3
    else:
        modes = {on_device: 30}
    args.running = args.running or (4 if args.smoke else 256)
    # A smoke run of every mode takes the core-process path too; `--generate --smoke` alone
    # (gpu_check's CPU dry run, which only checks its own plumbing) leaves it out.
    args.core_process = args.core_process or (args.smoke and not args.generate)
    if (args.smoke or args.generate or args.arrivals) and args.model is None:  # small device
        args.model = str(save_random_llama())
    for mode, steps in modes.items():
        steps = args.steps or (3 if args.smoke else steps)
        mode(argparse.Namespace(**{**vars(args), "steps": steps}))


if __name__ == "__main__":
    main()
