"""pagedjax: a paged-KV-cache LLM inference engine in JAX.

The public names are imported lazily, so `pagedjax.core` (pure Python) stays usable without
importing JAX.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "pagedjax.llm",
    "LLMEngine": "pagedjax.engine",
    "EngineConfig": "pagedjax.config",
    "SamplingParams": "pagedjax.sampling_params",
    "RequestOutputKind": "pagedjax.sampling_params",
    "RequestOutput": "pagedjax.outputs",
    "CompletionOutput": "pagedjax.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
