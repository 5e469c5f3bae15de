"""Command line: `pagedjax generate PROMPT...`, `pagedjax chat`, `pagedjax serve` and
`pagedjax bench`."""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    parser.add_argument("--kv-cache-dtype", default=None, help="auto, bfloat16, fp8, ...")
    parser.add_argument("--dtype", default=None, help="auto (the checkpoint's on a GPU), ...")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="the card's share (0.9)"
    )
    _add_kv_scale_args(parser)
    _add_parallel_args(parser)
    _add_speculative_args(parser)
    _add_int8_arg(parser)


def _add_int8_arg(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        default=None,
        help="CPU, GGUF Q4_0/Q4_1/Q8_0 weights: quantize activations to int8 as llama.cpp does "
        "(faster; tokens may differ from float32)",
    )


def _speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object, as vLLM's command line takes it."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _add_speculative_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )


def _kv_cache_scales(text: str) -> float | str:
    """--kv-cache-scales: a number, else a JSON file's path."""
    try:
        return float(text)
    except ValueError:
        return text


def _add_kv_scale_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        default=None,
        help="fp8 KV: compute per-layer, per-head scales from a calibration pass at start-up",
    )
    parser.add_argument(
        "--kv-cache-scales",
        type=_kv_cache_scales,
        default=None,
        help='fp8 KV scales: a number, or a JSON file {"k_scale": ..., "v_scale": ...}',
    )


def _add_parallel_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "-tp", "--tensor-parallel-size", type=int, default=None, help="devices per model copy"
    )
    parser.add_argument(
        "-dp", "--data-parallel-size", type=int, default=None, help="model copies (replicas)"
    )
    hosts = "several hosts (one process each): "
    parser.add_argument("--coordinator-address", default=None, help=hosts + "process 0's host:port")
    parser.add_argument("--num-processes", type=int, default=None, help=hosts + "how many")
    parser.add_argument("--process-id", type=int, default=None, help=hosts + "this one's id")


PARALLEL_OPTIONS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "coordinator_address",
    "num_processes",
    "process_id",
)


def _make_llm(args: argparse.Namespace):
    from pagedjax.llm import LLM

    names = (
        "dtype",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "calculate_kv_scales",
        "kv_cache_scales",
        "speculative_config",
        "int8_activations",
        *PARALLEL_OPTIONS,
    )
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        return LLM(args.model, max_model_len=args.max_model_len, **options)
    except ValueError as e:  # a bad option or model: its message says what to change
        raise SystemExit(f"pagedjax {args.command}: {e}") from e


def _sampling_params(args: argparse.Namespace):
    from pagedjax.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )


def _generate(args: argparse.Namespace) -> int:
    from pagedjax.llm import chat_prompt_ids

    start = time.perf_counter()
    llm = _make_llm(args)
    loaded = time.perf_counter()
    params = _sampling_params(args)
    if args.no_chat_template or not llm.get_tokenizer().chat_template:
        prompts = list(args.prompts)
    else:
        tokenizer = llm.get_tokenizer()
        prompts = [
            chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in args.prompts
        ]
    if args.stream:
        for output in llm.stream(prompts, params):
            if len(prompts) == 1:
                print(output.deltas[0], end="", flush=True)
            elif output.finished:
                print(f"[{output.request_id}] {output.outputs[0].text.strip()}", flush=True)
        if len(prompts) == 1:
            print()
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output in outputs if llm.llm_engine.is_leader else ():  # process 0 prints
            print(output.outputs[0].text.strip())
    if args.verbose:
        stats = llm.llm_engine.stats()
        print(
            f"[pagedjax] load {loaded - start:.2f}s, total {time.perf_counter() - start:.2f}s, "
            f"{stats['num_generated_tokens']} tokens, {stats['num_compilations']} compilations",
            file=sys.stderr,
        )
    return 0


def _chat(args: argparse.Namespace) -> int:
    from pagedjax.llm import chat_prompt_ids

    llm = _make_llm(args)
    params = _sampling_params(args)
    messages: list[dict] = []
    print("pagedjax chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        reply = ""
        for output in llm.stream([chat_prompt_ids(llm.get_tokenizer(), messages)], params):
            print(output.deltas[0], end="", flush=True)
            reply = output.outputs[0].text
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(args: argparse.Namespace) -> int:
    script = BENCHMARKS / f"{args.script}.py"
    if not script.is_file():
        helpers = {"report", "triton_compile", "workloads"}
        available = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in helpers)
        raise SystemExit(
            f"no benchmark {args.script!r} in {BENCHMARKS}; benchmarks run from a source "
            f"checkout (pip install -e .). Available: {', '.join(available) or 'none'}"
        )
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import their shared helpers
    sys.argv = [str(script), *args.script_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags, and the engine options it passes on (unset ones keep
    EngineConfig's defaults)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: the path's)"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 once this many requests wait (default: no limit)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="compile each step shape on first use instead of before listening",
    )
    parser.add_argument(
        "--no-core-process",
        dest="core_process",
        action="store_false",
        help="run the engine core in the server's process (it has a process of its own by "
        "default, so HTTP and detokenizing never hold its interpreter lock)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    engine = parser.add_argument_group("engine options (pagedjax.EngineConfig)")
    for flag, kind in (
        ("--max-model-len", int),
        ("--max-num-seqs", int),
        ("--max-num-batched-tokens", int),
        ("--num-kv-blocks", int),
        ("--block-size", int),
        ("--kv-cache-memory-bytes", int),
        ("--gpu-memory-utilization", float),
        ("--long-prefill-token-threshold", int),
        ("--dtype", str),
        ("--kv-cache-dtype", str),
        ("--attention-backend", str),
        ("--scheduling-policy", str),
        ("--seed", int),
    ):
        engine.add_argument(flag, type=kind, default=None)
    _add_lora_args(engine)
    engine.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
    )
    _add_kv_scale_args(engine)
    _add_parallel_args(engine)
    _add_speculative_args(engine)
    engine.add_argument(
        "--no-attention-fallback",
        dest="attention_fallback",
        action="store_false",
        default=None,
        help="fail at start-up if the Pallas kernels fail, instead of running XLA's attention",
    )
    _add_int8_arg(engine)
    engine.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        default=None,
        help="one block table over every layer of a sliding-window model (with the host "
        "tier), instead of KV cache groups that free what the windows passed",
    )
    engine.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=None,
        help="wait for each step before scheduling the next",
    )
    engine.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="decode steps run per dispatch when every sequence decodes (default 1)",
    )


def _add_lora_args(engine: argparse._ArgumentGroup) -> None:
    """vLLM's LoRA flags: the EngineConfig options and the adapters served from the start."""
    for flag in ("--max-loras", "--max-lora-rank", "--max-cpu-loras"):
        engine.add_argument(flag, type=int, default=None)
    engine.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters over the model (--lora-modules, /v1/load_lora_adapter)",
    )
    engine.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT adapter directories served under these model names (with --enable-lora)",
    )


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    from pagedjax.entrypoints.openai.api_server import run_server

    try:
        return run_server(args)
    except KeyboardInterrupt:  # Ctrl-C while loading: the engine is already shut down
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedjax", description="Paged-KV LLM inference in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete each prompt (greedy by default)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    _add_engine_args(gen)
    gen.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.set_defaults(run=_generate)
    chat = commands.add_parser("chat", help="interactive chat, streaming the replies")
    _add_engine_args(chat)
    chat.set_defaults(run=_chat)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _add_serve_args(serve)
    serve.set_defaults(run=_serve)
    bench = commands.add_parser(
        "bench", help="run a script of benchmarks/ (a source checkout), e.g. bench throughput"
    )
    bench.add_argument("script", help="benchmark name: throughput, latency, roofline, ...")
    bench.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own flags")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
