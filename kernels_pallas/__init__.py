"""Paged KV cache, attention metadata, the jnp reference attention and the Pallas kernels.

The Pallas exports are resolved lazily, so importing `kernels_pallas.kv_cache` (the engine does
on every start) does not import Pallas. The Pallas entry point is exported as
`pallas_paged_attention`: the name `kernels_pallas.paged_attention` is its submodule (import
the function as `from kernels_pallas.paged_attention import paged_attention`).
"""

from __future__ import annotations

import importlib

_LAZY_EXPORTS = {
    "pallas_paged_attention": "kernels_pallas.paged_attention",
    "check_block_tables": "kernels_pallas.paged_attention",
    "checkify_metadata": "kernels_pallas.paged_attention",
    "metadata_is_valid": "kernels_pallas.paged_attention",
    "RaggedConfig": "kernels_pallas.ragged_paged_attention",
    "ragged_paged_attention_kernel": "kernels_pallas.ragged_paged_attention",
    "DecodeConfig": "kernels_pallas.decode_attention",
    "decode_attention_kernel": "kernels_pallas.decode_attention",
    "choose_num_splits": "kernels_pallas.decode_attention",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        module = importlib.import_module(_LAZY_EXPORTS[name])
        return getattr(module, "paged_attention" if name == "pallas_paged_attention" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
