"""vLLM's engine keywords that are not pagedjax options, so that vLLM scripts run unchanged.

`LLM(model, **kwargs)` takes every `EngineConfig` field, and the keywords below: each is
either mapped onto an option (`num_gpu_blocks_override` is `num_kv_blocks`) or accepted with
the meaning it has here, for the values that mean something here. Another value, or an
unknown keyword, raises an error naming it and saying what is supported. The table in
`docs/vllm_compat.md` lists them for users.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Keyword:
    """A vLLM keyword: the values accepted here, how to say them, and what it means here."""

    accepts: Callable[[Any], bool]
    supported: str  # the accepted values, for the error
    meaning: str
    option: str | None = None  # the EngineConfig field it sets, if any


def _any(value: Any) -> bool:
    return True


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


VLLM_KEYWORDS: dict[str, Keyword] = {
    "trust_remote_code": Keyword(
        _any, "True or False", "no model code is downloaded or run: the architectures are ours"
    ),
    "enforce_eager": Keyword(
        _any,
        "True or False",
        "JAX compiles each bucketed step shape once; there is no eager mode or CUDA graph",
    ),
    "cpu_offload_gb": Keyword(_one_of(0, 0.0), "0", "weights stay on the device"),
    "tokenizer_mode": Keyword(
        _one_of("auto", "hf"), '"auto" or "hf"', "the Hugging Face (fast) tokenizer"
    ),
    "skip_tokenizer_init": Keyword(_one_of(False), "False", "the tokenizer always loads"),
    "revision": Keyword(_one_of(None, "main"), 'None or "main"', "no model hub: local files"),
    "tokenizer_revision": Keyword(
        _one_of(None, "main"), 'None or "main"', "no model hub: local files"
    ),
    "code_revision": Keyword(_one_of(None), "None", "no remote code"),
    "download_dir": Keyword(_any, "any", "no model hub: nothing is downloaded"),
    "load_format": Keyword(
        _one_of("auto", "safetensors", "gguf"),
        '"auto", "safetensors" or "gguf"',
        "read from the file's own format",
    ),
    "quantization": Keyword(
        _one_of(None, "gguf"),
        'None or "gguf"',
        "a .gguf file's block-quantized weights are used as stored",
    ),
    "num_gpu_blocks_override": Keyword(
        lambda v: v is None or (isinstance(v, int) and v >= 2),
        "None or an int >= 2",
        "the KV pool's blocks",
        option="num_kv_blocks",
    ),
    "max_seq_len_to_capture": Keyword(_any, "any", "no CUDA graphs: every shape is compiled"),
    "disable_custom_all_reduce": Keyword(_any, "True or False", "XLA's collectives run"),
    "disable_log_stats": Keyword(_any, "True or False", "statistics are kept either way"),
    "enable_chunked_prefill": Keyword(
        _one_of(None, True), "True", "prefills are always chunked under the token budget"
    ),
    "pipeline_parallel_size": Keyword(_one_of(1), "1", "no pipeline parallelism"),
    "distributed_executor_backend": Keyword(
        _one_of(None, "mp", "uni", "external_launcher"),
        'None, "mp", "uni" or "external_launcher"',
        "JAX runs one process per host (see docs/parallelism.md)",
    ),
    "compilation_config": Keyword(_any, "any", "XLA compiles; its options come from XLA_FLAGS"),
    "hf_overrides": Keyword(_one_of(None, {}), "None", "the checkpoint's config as it is"),
    "generation_config": Keyword(
        _one_of("auto", "vllm"),
        '"auto" or "vllm"',
        "SamplingParams() defaults are vLLM's; the model's generation config sets none",
    ),
    "task": Keyword(_one_of("auto", "generate"), '"auto" or "generate"', "text generation"),
    "runner": Keyword(_one_of("auto", "generate"), '"auto" or "generate"', "text generation"),
    "limit_mm_per_prompt": Keyword(_one_of(None, {}), "None", "text models only"),
    "disable_async_output_proc": Keyword(
        _any, "True or False", "outputs are processed while the next step runs (async_scheduling)"
    ),
    "served_model_name": Keyword(_any, "any", "the name the server answers to"),
    "max_logprobs": Keyword(
        lambda v: isinstance(v, int) and 0 <= v <= 20,
        "an int in [0, 20]",
        "at most 20 logprobs per token (SamplingParams checks it)",
    ),
}


def split_options(options: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """The EngineConfig options among `options`: vLLM keywords are checked (ValueError for an
    unsupported value) and mapped or dropped; TypeError names any keyword that is neither."""
    engine = {}
    unknown = []
    for name, value in options.items():
        if name in known:
            engine[name] = value
            continue
        keyword = VLLM_KEYWORDS.get(name)
        if keyword is None:
            unknown.append(name)
            continue
        if not keyword.accepts(value):
            raise ValueError(
                f"{name}={value!r} is not supported: pagedjax takes {keyword.supported} "
                f"({keyword.meaning})"
            )
        if keyword.option is not None and value is not None:
            engine[keyword.option] = value
    # vLLM turns batch invariance on from the environment, for its server as for LLM().
    from_environment = os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
    if from_environment and "batch_invariant" in known and "batch_invariant" not in engine:
        engine["batch_invariant"] = True
    if unknown:
        raise TypeError(
            f"unknown engine options {sorted(unknown)}; pagedjax options: {sorted(known)}; "
            f"vLLM keywords accepted: {sorted(VLLM_KEYWORDS)}"
        )
    return engine
