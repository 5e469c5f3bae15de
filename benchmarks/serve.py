"""Online serving over HTTP, like `vllm bench serve`: starts `pagedjax serve` as a subprocess on a
free localhost port, streams seeded requests to /v1/completions at Poisson rates, and compares
saturation throughput with the same requests through `LLM.generate` in this process.

    python benchmarks/serve.py [--workload W1|W2] [--input-len N] [--requests 32]
        [--rates 1,2,4,inf] [--max-tokens 64] [--max-concurrency N] [--no-offline]
        [--model PATH] [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N]
        [--num-kv-blocks N] [--server-args="--flag value ..."] [--compare-in-process]
        [--random-model] [--seed 0] [--quick]
    python benchmarks/serve.py --soak [N] [--soak-concurrency 32] [--disconnect-fraction 0.1]
        [--soak-warmup N]

Rates: each rate gets its own --requests prompts (token ids, greedy, ignore_eos, exactly
max_tokens new tokens; W1: 25-200 prompt tokens x --max-tokens, W2: 32-512 x 16-512,
--input-len: prompts of exactly N tokens), sent at seeded Poisson arrival times (inf: all at
once), streamed with `stream_options.include_usage`. Per rate: TTFT (send to the first chunk
with text), TPOT ((end - first chunk) / (tokens - 1)), ITL (gaps between chunks with text),
end-to-end latency, p50/p90/p99 each; requests/s and output tokens/s from the first send to the
last end, tokens counted from `usage`. The server compiles shapes on first use, so two
unmeasured waves of other prompts go first (a burst, then the highest finite rate).
Saturation: the inf rate's requests run first offline through `LLM.generate` with the same
engine options (after `warmup()` and the same burst wave; the engine is freed before the
server starts), then over HTTP; output tokens/s of both and their ratio (target >= 0.9).
--compare-in-process: the inf rate's requests again, after the same warm-up, on a second
server started with `--no-core-process` (the engine core on a thread of the server's process):
output tok/s of both and their ratio. Writes results/serve.json (W2: serve_w2.json).

--soak N (default 2000): N short requests (1-8 tokens, random sampling parameters, completions
and chat, streaming and not) with at most --soak-concurrency in flight; --disconnect-fraction
of the streaming clients close their stream after its first chunk. After the drain it scrapes
/metrics (running, waiting and KV blocks in use must be 0) and reads the server's RSS (VmRSS
of the server and its children) after --soak-warmup requests (default 16 x concurrency: fewer
left shapes to compile mid-soak, which read as growth) and at the end (growth < 5%), with a
trace every 10 s; any error response fails the run. Writes results/serve_soak.json; exits 1
if a check fails.

--quick shrinks either mode to a smoke test (4 requests at 4 and inf req/s x 16 tokens; a soak
of 64 requests); its results go to results/serve_quick.json / serve_soak_quick.json. Its
numbers check that everything runs, nothing more: a shape compiled on first use in its
sub-second rates can halve them. --smoke is smaller still, for tests/test_benchmarks.py: 2
requests at inf req/s x 4 tokens (a soak of 16) on a tiny random Llama unless --model is given,
its files in a temporary folder. --random-model: that tiny Llama (random token ids) at full
size, so the server's host work, not the model, decides the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import (  # noqa: E402
    TOPICS,
    kv_blocks,
    make_prompts,
    poisson_arrivals,
    save_random_llama,
    sized_prompts,
    w2,
)

REPO = Path(__file__).resolve().parent.parent
QUANTILES = (50, 90, 99)
# Gauge names in the server's /metrics (pagedjax/entrypoints/openai/metrics.py).
RUNNING = "pagedjax:num_requests_running"
WAITING = "pagedjax:num_requests_waiting"
BLOCKS_IN_USE = "pagedjax:kv_cache_blocks_used"


@dataclass(frozen=True)
class Job:
    """One HTTP request: the endpoint, its JSON body, and whether the client hangs up after the
    first chunk with text."""

    path: str
    body: dict
    disconnect: bool = False
    expected_tokens: int | None = None  # ignore_eos requests must produce exactly this many


@dataclass
class Result:
    send: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks whose text is not empty
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    disconnected: bool = False


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    log: Path


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> float:
    """Polls GET /health until it answers 200; returns the seconds it took."""
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode} during start-up:\n{log_tail(log)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    return time.perf_counter() - start
            time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{log_tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (uvicorn's graceful shutdown, without the KeyboardInterrupt traceback SIGINT
    ends with); after 30 s SIGKILL to the server's process group (its own session: only what
    it started)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print(f"server {proc.pid} ignored SIGTERM for 30 s: killing its process group")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def serve(engine_args: list[str], timeout_s: float, log: Path | None = None) -> Iterator[Server]:
    """Runs `python -m pagedjax.cli serve` on a free port until the block exits (also on
    Ctrl-C or an error). Its output goes to `log`, or to a temporary file that is deleted
    unless the run fails."""
    port = free_port()
    keep = log is not None
    if log is None:
        fd, name = tempfile.mkstemp(prefix="pagedjax-serve-", suffix=".log")
        os.close(fd)
        log = Path(name)
    cmd = [sys.executable, "-m", "pagedjax.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *engine_args]
    print("server:", shlex.join(cmd[1:]), f"(log: {log})", flush=True)
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        # A session of its own: Ctrl-C reaches only this script, which then stops the server.
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ready_s = wait_healthy(proc, url, log, timeout_s)
        print(f"server {proc.pid} healthy after {ready_s:.1f} s", flush=True)
        yield Server(url, proc.pid, log)
    except BaseException:
        keep = True
        raise
    finally:
        stop_server(proc)
        if keep:
            print(f"server log: {log}")
        else:
            log.unlink(missing_ok=True)


def tree_rss_mib(pid: int) -> float:
    """VmRSS of `pid` and all its descendants (an engine in a child process counts too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # The command name is in parentheses and may hold spaces: split after it.
                stat = (entry / "stat").read_text().rpartition(")")[2].split()
                children.setdefault(int(stat[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        with contextlib.suppress(OSError):
            for line in (Path("/proc") / str(current) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format: each sample's value, summed over label sets per metric name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_labels.split("{")[0].strip()
        with contextlib.suppress(ValueError, IndexError):
            values[name] = values.get(name, 0.0) + float(rest.split()[0])
    return values


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10.0).text)


def wait_drained(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Scrapes /metrics until nothing runs or waits (aborts of disconnected clients may land a
    step after their response ended); returns the last scrape."""
    deadline = time.perf_counter() + timeout_s
    while True:
        metrics = scrape(url)
        if metrics.get(RUNNING, 0) == 0 and metrics.get(WAITING, 0) == 0:
            return metrics
        if time.perf_counter() > deadline:
            return metrics
        time.sleep(0.5)


def model_name(url: str) -> str | None:
    """The served model's id from /v1/models (the body's "model" field), None if not listed."""
    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        return httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    return None


# ---------------------------------------------------------------------------- the client


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, job: Job) -> Result:
    """Sends one request and times its chunks. A chunk "carries tokens" when its text is not
    empty: a token that decodes to nothing arrives with a later chunk's text."""
    result = Result(send=time.perf_counter())
    body = job.body
    try:
        if not body.get("stream"):
            response = await client.post(job.path, json=body)
            result.end = time.perf_counter()
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            usage = response.json().get("usage") or {}
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
            result.chunk_times.append(result.end)
            return result
        done = False
        async with client.stream("POST", job.path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                result.end = time.perf_counter()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error chunk: {json.dumps(chunk)[:200]}"
                    break
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                if chunk_text(chunk):
                    result.chunk_times.append(now)
                    if job.disconnect:
                        # Leaving the block closes the connection with the body unread.
                        result.disconnected = True
                        break
        result.end = time.perf_counter()
        if not (done or result.disconnected or result.error):
            result.error = "stream ended without [DONE]"
        elif done and not result.output_tokens:
            result.error = "no usage chunk (stream_options.include_usage)"
        elif done and job.expected_tokens and result.output_tokens != job.expected_tokens:
            result.error = f"{result.output_tokens} tokens, expected {job.expected_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.end = time.perf_counter()
        result.error = f"{type(error).__name__}: {error}"
    return result


def async_client(url: str) -> httpx.AsyncClient:
    # No pool limit: at rate inf every request is in flight at once.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits)


async def run_arrivals(
    url: str, jobs: list[Job], arrivals: list[float], limit: int | None
) -> list[Result]:
    """Sends each job at its arrival time (seconds after the start), at most `limit` in
    flight; returns the results in job order."""
    gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    async with async_client(url) as client:
        start = time.perf_counter()

        async def one(job: Job, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                return await send(client, job)

        return list(await asyncio.gather(*(one(j, a) for j, a in zip(jobs, arrivals, strict=True))))


async def run_bounded(url: str, jobs: list[Job], concurrency: int) -> list[Result]:
    """Keeps `concurrency` requests in flight until every job has been sent."""
    results: list[Result | None] = [None] * len(jobs)
    queue = iter(range(len(jobs)))
    async with async_client(url) as client:

        async def worker() -> None:
            for i in queue:  # one shared iterator: each job goes to exactly one worker
                results[i] = await send(client, jobs[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


# ---------------------------------------------------------------------------- rates


def percentiles(prefix: str, values: list[float], scale: float, unit: str) -> dict:
    if not values:
        return {f"{prefix}_p{q}_{unit}": float("nan") for q in QUANTILES}
    return {f"{prefix}_p{q}_{unit}": scale * float(np.percentile(values, q)) for q in QUANTILES}


def summarize(results: list[Result]) -> dict:
    """Latency percentiles and throughput of one rate's results (errors excluded)."""
    good = [r for r in results if not r.error and r.chunk_times]
    ttft = [r.chunk_times[0] - r.send for r in good]
    tpot = [(r.end - r.chunk_times[0]) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    itl = [gap for r in good for gap in np.diff(r.chunk_times).tolist()]
    e2e = [r.end - r.send for r in good]
    span = max((r.end for r in good), default=0.0) - min((r.send for r in results), default=0.0)
    output = sum(r.output_tokens for r in good)
    summary = {"completed": len(good), "errors": len(results) - len(good)}
    summary |= percentiles("ttft", ttft, 1.0, "s")
    summary |= percentiles("tpot", tpot, 1000.0, "ms")
    summary |= percentiles("itl", itl, 1000.0, "ms")
    summary |= percentiles("e2e", e2e, 1.0, "s")
    summary["seconds"] = span
    summary["request_throughput"] = len(good) / span if span > 0 else 0.0
    summary["output_tokens_per_s"] = output / span if span > 0 else 0.0
    summary["output_tokens"] = output
    return summary


def completion_job(model: str | None, prompt: list[int], max_tokens: int) -> Job:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM's extension: exact output lengths, as offline
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return Job("/v1/completions", body, expected_tokens=max_tokens)


def greedy_jobs(model: str | None, prompts: list[list[int]], max_tokens: list[int]) -> list[Job]:
    return [completion_job(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    return [0.0] * count if math.isinf(rate) else poisson_arrivals(rate, count, seed)


def request_set(
    tokenizer, args: argparse.Namespace, count: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and max_tokens of one rate's requests."""
    if args.random_ids:
        # The tiny model's word-level tokenizer reads English as all-unknown ids, whose greedy
        # continuation decodes to no text: random words give streamed text to time.
        rng = random.Random(seed)
        vocab = len(tokenizer)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(count)
        ]
        return prompts, [args.max_tokens] * count
    if args.input_len:
        return sized_prompts(tokenizer, [args.input_len] * count, seed), [args.max_tokens] * count
    if args.workload == "W2":
        prompts, outputs = w2(tokenizer, 256, seed)
        if args.max_tokens:
            outputs = [args.max_tokens] * 256
        return prompts[:count], outputs[:count]
    return make_prompts(tokenizer, count, seed), [args.max_tokens] * count


def run_offline(
    args: argparse.Namespace, options: dict, seed: int, warm_seed: int
) -> tuple[dict, object]:
    """The saturation run's requests (`seed`) through `LLM.generate`, after the engine's warm-up
    and the same warm-up wave the server gets (`warm_seed`); returns the timing and the
    tokenizer (the HTTP phase builds its prompts with it)."""
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(args.model, **options)
    tokenizer = llm.get_tokenizer()
    runner = llm.llm_engine.engine_core.worker.runner
    warmup_s = runner.warmup()

    def greedy(max_tokens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]

    warm_prompts, warm_outputs = request_set(tokenizer, args, args.requests, warm_seed)
    llm.generate(warm_prompts, greedy(warm_outputs), use_tqdm=False)
    prompts, max_tokens = request_set(tokenizer, args, args.requests, seed)
    params = greedy(max_tokens)
    print(f"offline: {len(prompts)} requests, {sum(max_tokens)} output tokens", flush=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Free the engine before the server starts: the two must not hold memory at once.
    del llm, runner, outputs
    gc.unfreeze()  # the engine froze its start-up objects; cycles among them need a collection
    gc.collect()
    offline = {
        "offline_warmup_s": warmup_s,
        "offline_seconds": elapsed,
        "offline_output_tokens": generated,
        "offline_output_tokens_per_s": generated / elapsed,
    }
    return offline, tokenizer


def engine_options(args: argparse.Namespace, count: int) -> dict:
    """The engine options both the offline engine and the server get; the pool holds every
    request of a rate at once."""
    if args.input_len:
        longest = args.input_len + args.max_tokens
    elif args.workload == "W1":
        longest = 200 + args.max_tokens
    else:
        longest = 1024  # W2: up to 512 + 512
    max_model_len = args.max_model_len or max(512, longest)
    blocks = args.num_kv_blocks or max(kv_blocks(count, longest), kv_blocks(1, max_model_len))
    return {
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": blocks,
    }


def server_args(args: argparse.Namespace, options: dict) -> list[str]:
    flags = ["--model", args.model] if args.model else []
    for key, value in options.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags + shlex.split(args.server_args)


def print_rates(rates: list[float], per_rate: list[dict]) -> None:
    """One row per rate, like vllm bench serve's summary."""
    header = (
        f"{'rate':>6} {'ok':>4} {'err':>4} {'req/s':>7} {'tok/s':>8} "
        f"{'TTFT p50/p90/p99 s':>20} {'TPOT p50/p90/p99 ms':>21} {'ITL p50/p90/p99 ms':>21}"
    )
    print(header)
    for rate, s in zip(rates, per_rate, strict=True):

        def three(name: str, unit: str, digits: int, s: dict = s) -> str:
            return "/".join(f"{s[f'{name}_p{q}_{unit}']:.{digits}f}" for q in QUANTILES)

        print(
            f"{rate:>6g} {s['completed']:>4} {s['errors']:>4} {s['request_throughput']:>7.2f} "
            f"{s['output_tokens_per_s']:>8.1f} {three('ttft', 's', 2):>20} "
            f"{three('tpot', 'ms', 1):>21} {three('itl', 'ms', 1):>21}"
        )


def bench_rates(args: argparse.Namespace) -> dict:
    rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    if not args.no_offline and math.inf not in rates:
        rates.append(math.inf)  # the saturation comparison is the inf rate
    options = engine_options(args, args.requests)
    # Different prompts per rate (seed + k): no prefix-cache hits across rates.
    seeds = {rate: args.seed + k for k, rate in enumerate(rates)}
    warm_seed = args.seed + 1000  # the warm-up wave's prompts, offline and over HTTP
    # Other work on the machine skews CPU timings: the load average says how quiet it was.
    result: dict = {"load_average_1m": os.getloadavg()[0], "engine_options": json.dumps(options)}
    if args.no_offline:
        from models.loader import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    else:
        offline, tokenizer = run_offline(args, options, seeds[math.inf], warm_seed)
        result |= offline
    sets = {rate: request_set(tokenizer, args, args.requests, seeds[rate]) for rate in rates}
    label = f"W2 (first {args.requests} of 256)" if args.workload == "W2" else args.workload
    if args.input_len:
        label = f"prompts of {args.input_len} tokens"
    result["workload"] = f"{label}; {args.requests} requests per rate, greedy, ignore_eos"
    result["max_tokens"] = args.max_tokens or "16-512 (W2)"
    per_rate = []
    with serve(server_args(args, options), args.server_timeout, args.server_log) as server:
        model = model_name(server.url)
        result["http_warmup_s"] = warm_up(args, server.url, model, tokenizer, rates, warm_seed)
        for rate in rates:
            jobs = greedy_jobs(model, *sets[rate])
            arrivals = arrival_times(rate, len(jobs), seeds[rate])
            print(f"rate {rate:g}: {len(jobs)} requests ...", flush=True)
            results = asyncio.run(run_arrivals(server.url, jobs, arrivals, args.max_concurrency))
            per_rate.append(summarize(results))
            for r in results:
                if r.error:
                    print(f"  error: {r.error}")
            result |= {f"rate_{rate:g}_{k}": v for k, v in per_rate[-1].items()}
        after = wait_drained(server.url)
        result["running_after"] = after.get(RUNNING, float("nan"))
        result["waiting_after"] = after.get(WAITING, float("nan"))
        result["kv_blocks_in_use_after"] = after.get(BLOCKS_IN_USE, float("nan"))
    print_rates(rates, per_rate)
    if args.compare_in_process and math.inf in rates:
        result |= in_process_saturation(args, options, tokenizer, rates, sets, warm_seed)
        own, shared = (result[f"{p}rate_inf_output_tokens_per_s"] for p in ("", "in_process_"))
        result["core_process_vs_in_process"] = own / shared
        print(
            f"saturation: the engine core in its own process {own:.1f} vs in the server's "
            f"{shared:.1f} output tok/s: {own / shared:.3f}x"
        )
    if not args.no_offline:
        http = result["rate_inf_output_tokens_per_s"]
        result["http_vs_offline"] = http / result["offline_output_tokens_per_s"]
        print(
            f"saturation: HTTP {http:.1f} vs offline "
            f"{result['offline_output_tokens_per_s']:.1f} output tok/s: "
            f"{result['http_vs_offline']:.3f} (target >= 0.9)"
        )
    result["errors"] = sum(s["errors"] for s in per_rate)
    return result


def warm_up(
    args: argparse.Namespace, url: str, model: str | None, tokenizer, rates, warm_seed: int
) -> float:
    """Unmeasured waves (the server compiles a shape when a step first needs it): a burst
    (what the offline run's warm-up wave is) and a wave at the highest finite rate, whose mixed
    prefill and decode steps need other token counts than a burst. Returns the seconds."""
    start = time.perf_counter()
    finite = [rate for rate in rates if not math.isinf(rate)]
    for k, rate in enumerate([math.inf, *finite[-1:]]):
        jobs = greedy_jobs(model, *request_set(tokenizer, args, args.requests, warm_seed + k))
        arrivals = arrival_times(rate, len(jobs), warm_seed + k)
        asyncio.run(run_arrivals(url, jobs, arrivals, args.max_concurrency))
    return time.perf_counter() - start


def in_process_saturation(
    args: argparse.Namespace, options: dict, tokenizer, rates, sets: dict, warm_seed: int
) -> dict:
    """The inf rate again on a server whose engine core runs in its own process's thread
    (`--no-core-process`, the server before issue 41), after the same warm-up."""
    flags = [*server_args(args, options), "--no-core-process"]
    with serve(flags, args.server_timeout) as server:
        model = model_name(server.url)
        warm_up(args, server.url, model, tokenizer, rates, warm_seed)
        jobs = greedy_jobs(model, *sets[math.inf])
        print(f"in-process core, rate inf: {len(jobs)} requests ...", flush=True)
        results = asyncio.run(run_arrivals(server.url, jobs, [0.0] * len(jobs), None))
    summary = summarize(results)
    return {f"in_process_rate_inf_{k}": v for k, v in summary.items()}


# ---------------------------------------------------------------------------- soak


def soak_jobs(
    rng: random.Random, count: int, vocab: int, model: str | None, disconnect: float
) -> list[Job]:
    """Short requests with random sampling parameters: completions on random token ids and
    chat on short texts, mostly streaming; `disconnect` of the streams hang up early."""
    jobs = []
    for i in range(count):
        stream = rng.random() < 0.85
        body: dict = {
            "max_tokens": rng.randint(1, 8),
            "temperature": rng.choice([0.0, 0.8, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": i,
            "stream": stream,
        }
        if rng.random() < 0.3:
            body["stop"] = ["\n"]
        if stream:
            body["stream_options"] = {"include_usage": True}
        if model:
            body["model"] = model
        if rng.random() < 0.7:
            body["prompt"] = [rng.randrange(100, vocab) for _ in range(rng.randint(4, 24))]
            path = "/v1/completions"
        else:
            text = f"Tell me about {rng.choice(TOPICS)} in one sentence."
            body["messages"] = [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        jobs.append(Job(path, body, disconnect=stream and rng.random() < disconnect))
    return jobs


async def traced(
    work: Awaitable[list[Result]], pid: int, every_s: float = 10.0
) -> tuple[list[Result], list[tuple[float, float]]]:
    """Runs `work` while sampling the server's RSS every `every_s` seconds: a curve that
    flattens is warm-up (shapes first compiled mid-soak), one that keeps rising a leak."""
    trace: list[tuple[float, float]] = []
    start = time.perf_counter()

    async def sample() -> None:
        while True:
            await asyncio.sleep(every_s)
            trace.append((time.perf_counter() - start, tree_rss_mib(pid)))

    sampler = asyncio.ensure_future(sample())
    try:
        return await work, trace
    finally:
        sampler.cancel()


def soak(args: argparse.Namespace) -> tuple[dict, bool]:
    from models.loader import load_tokenizer

    vocab = len(load_tokenizer(args.model))
    options = {  # as soak.py: a small pool, so that RSS is mostly the server's own
        "max_model_len": args.max_model_len or 256,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks or kv_blocks(1, 16384),
    }
    rng = random.Random(args.seed)
    result: dict = {
        "load_average_1m": os.getloadavg()[0],
        "requests": args.soak,
        "concurrency": args.soak_concurrency,
        "disconnect_fraction": args.disconnect_fraction,
        "warmup_requests": args.soak_warmup or 16 * args.soak_concurrency,
    }
    with serve(server_args(args, options), args.server_timeout, args.server_log) as server:
        model = model_name(server.url)
        # Warm-up wave: compiles the shapes the soak uses, so RSS at start excludes them.
        warm_count = args.soak_warmup or 16 * args.soak_concurrency
        warm = soak_jobs(rng, warm_count, vocab, model, args.disconnect_fraction)
        warm_results = asyncio.run(run_bounded(server.url, warm, args.soak_concurrency))
        wait_drained(server.url)
        rss_start = tree_rss_mib(server.pid)
        jobs = soak_jobs(rng, args.soak, vocab, model, args.disconnect_fraction)
        start = time.perf_counter()
        results, trace = asyncio.run(
            traced(run_bounded(server.url, jobs, args.soak_concurrency), server.pid)
        )
        sent_s = time.perf_counter() - start
        after = wait_drained(server.url)
        drained_s = time.perf_counter() - start
        rss_end = tree_rss_mib(server.pid)
        healthy = httpx.get(f"{server.url}/health", timeout=10.0).status_code == 200
    errors = [r.error for r in results if r.error]
    for error in sorted(set(errors))[:10]:
        print(f"  error ({errors.count(error)}x): {error}")
    warm_errors = sum(bool(r.error) for r in warm_results)
    blocks = after.get(BLOCKS_IN_USE, float("nan"))
    result |= {
        "seconds": sent_s,
        "seconds_to_drain": drained_s,
        "requests_per_s": args.soak / sent_s,
        "disconnected": sum(r.disconnected for r in results),
        "completed": sum(not r.error and not r.disconnected for r in results),
        "errors": len(errors),
        "warmup_errors": warm_errors,
        "output_tokens": sum(r.output_tokens for r in results),
        "running_after_drain": after.get(RUNNING, float("nan")),
        "waiting_after_drain": after.get(WAITING, float("nan")),
        "kv_blocks_in_use_after_drain": blocks,
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
        "rss_growth_pct": 100 * (rss_end - rss_start) / rss_start,
        "rss_trace_mib": " ".join(f"{t:.0f}s:{rss:.0f}" for t, rss in trace),
        "healthy_after": healthy,
    }
    checks = {
        "no errors": not errors and not warm_errors,
        "nothing running or waiting": result["running_after_drain"] == 0
        and result["waiting_after_drain"] == 0,
        "0 KV blocks in use": blocks == 0,
        "RSS growth < 5%": result["rss_growth_pct"] < 5.0,
        "healthy after": healthy,
    }
    failed = [name for name, ok in checks.items() if not ok]
    result["checks_failed"] = ", ".join(failed) or "none"
    return result, not failed


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--workload", choices=["W1", "W2"], default="W1")
    parser.add_argument("--input-len", type=int, default=None, help="prompts of exactly N tokens")
    parser.add_argument("--requests", type=int, default=32, help="requests per rate")
    parser.add_argument("--rates", default="1,2,4,inf", help="requests/s; inf: all at once")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per request (default 64; W2: 16-512)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight")
    parser.add_argument("--no-offline", action="store_true", help="skip the LLM.generate run")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 512 (W2 1024)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: fits a rate")
    parser.add_argument(
        "--server-args",
        default="",
        help='more flags for `pagedjax serve` only, as --server-args="--flag value"',
    )
    parser.add_argument(
        "--random-model",
        action="store_true",
        help="a tiny random Llama, whose device work is negligible: the serving host's cost",
    )
    parser.add_argument(
        "--compare-in-process",
        action="store_true",
        help="run the inf rate again on a server with --no-core-process (same run)",
    )
    parser.add_argument("--server-timeout", type=float, default=600.0, help="start-up limit, s")
    parser.add_argument(
        "--server-log", type=Path, default=None, help="keep the server's output in this file"
    )
    parser.add_argument(
        "--soak", type=int, nargs="?", const=2000, default=None, help="soak mode: N requests"
    )
    parser.add_argument("--soak-concurrency", type=int, default=32)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument(
        "--soak-warmup", type=int, default=None, help="warm-up requests (default 16 x concurrency)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute smoke test")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.max_tokens is None and (args.workload == "W1" or args.input_len):
        args.max_tokens = 64
    if args.quick:
        args.requests, args.rates, args.max_tokens = 4, "4,inf", 16
        args.max_num_seqs = min(args.max_num_seqs, 8)
        if args.soak is not None:
            args.soak, args.soak_concurrency = 64, 8
    if args.smoke:
        args.requests, args.rates, args.max_tokens = 2, "inf", 4
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
        if args.soak is not None:
            args.soak, args.soak_concurrency, args.soak_warmup = 16, 4, 4
    args.random_ids = (args.smoke and args.model is None) or args.random_model
    if args.random_ids:  # a tiny random Llama: the server starts and compiles in seconds
        args.model = str(save_random_llama())
    # SIGTERM runs the same teardown as Ctrl-C: the server must not outlive the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    suffix = "_quick" if args.quick else ""
    try:
        if args.soak is not None:
            result, ok = soak(args)
            report("serve_soak" + suffix, result, smoke=args.smoke)
            if not ok:
                sys.exit(1)
        else:
            name = "serve_w2" if args.workload == "W2" and not args.input_len else "serve"
            result = bench_rates(args)
            report(name + suffix, result, smoke=args.smoke)
            if args.smoke and result["errors"]:  # a smoke run exists to catch exactly this
                sys.exit(f"{result['errors']} requests failed")
    except KeyboardInterrupt:
        sys.exit("interrupted: server stopped")


if __name__ == "__main__":
    main()
