"""`LoRARequest`: which adapter a request runs with, as vLLM's `vllm.lora.request`."""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name, a positive id unique per adapter, and where PEFT saved it
    (empty for one added from memory with `LLM.add_lora`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"lora_int_id must be a positive int (0 is the base model), got "
                f"{self.lora_int_id!r}"
            )

    # vLLM's other names for the same fields.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
