"""LoRA adapters served over one base model (vLLM's `vllm.lora`): `LoRARequest` names one."""

from pagedjax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
