"""The attention backends the engine runs, by name: the one place a backend is registered.

A backend implements `kernels_pallas.backend.AttentionBackend`. To add one, write it (with its
tests) and add a line here; the platform's "auto" choice lives in `pagedjax/platforms/`. One
with a kernel of its own for decode-only steps sets `has_decode_kernel` (as "pallas" does):
the model runner then passes it `decode_only=True/False` statically, one compiled step each.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels_pallas.backend import AttentionBackend

# name -> "module:object", imported on first use (the Pallas kernels import Pallas).
BACKENDS = {
    "reference": "kernels_pallas.reference:REFERENCE",
    "xla": "kernels_pallas.xla_attention:XLA",
    "pallas": "kernels_pallas.paged_attention:PALLAS",
    # The Pallas backend with its decode kernel on Mosaic GPU (Hopper), not yet chosen by auto.
    "pallas_mosaic": "kernels_pallas.mosaic_decode_attention:PALLAS_MOSAIC",
    "cpu_native": "pagedjax.cpu_native.attention:CPU_NATIVE",
}


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(BACKENDS)}")
    module, attribute = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attribute)
