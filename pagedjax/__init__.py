"""pagedjax: a paged-KV-cache LLM inference engine in JAX.

The public names are imported lazily, so `pagedjax.core` (pure Python) stays usable without
importing JAX.
"""

from importlib import import_module

# vLLM's top-level names (`from vllm import ...`), and a few more users reach for first.
_EXPORTS = {
    "LLM": "pagedjax.llm",
    "LLMEngine": "pagedjax.engine",
    "AsyncLLM": "pagedjax.async_llm",
    "EngineConfig": "pagedjax.config",
    "SamplingParams": "pagedjax.sampling_params",
    "BeamSearchParams": "pagedjax.sampling_params",
    "StructuredOutputsParams": "pagedjax.sampling_params",
    "RequestOutputKind": "pagedjax.sampling_params",
    "RequestOutput": "pagedjax.outputs",
    "CompletionOutput": "pagedjax.outputs",
    "TextPrompt": "pagedjax.inputs",
    "TokensPrompt": "pagedjax.inputs",
    "PromptType": "pagedjax.inputs",
    "LoRARequest": "pagedjax.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
