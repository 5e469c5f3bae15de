"""The models a server answers to: the base model and its LoRA adapters (vLLM's
OpenAIServingModels). `/v1/models` lists them; a request's `model` names one; with LoRA on,
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` change the adapters while serving."""

from __future__ import annotations

from pagedjax.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ServingError,
    UnloadLoRAAdapterRequest,
)
from pagedjax.lora.request import LoRARequest


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules name=path ...` -> {name: path}; ValueError on a malformed one."""
    modules = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        modules[name] = path
    return modules


class ServingModels:
    def __init__(self, engine, base_name: str, root: str, max_model_len: int) -> None:
        """engine: an `AsyncLLM` (or anything with its LoRA calls)."""
        self.engine, self.base_name = engine, base_name
        self.root, self.max_model_len = root, max_model_len
        self.enable_lora: bool = engine.config.enable_lora
        self.loras: dict[str, LoRARequest] = {}
        self._next_id = 1

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model; 404 otherwise."""
        if model is None or model == self.base_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise ServingError(
                f"The model '{model}' does not exist", "model", 404, code="model_not_found"
            )
        return lora

    def cards(self) -> list[ModelCard]:
        base = ModelCard(id=self.base_name, root=self.root, max_model_len=self.max_model_len)
        adapters = [
            ModelCard(id=name, root=lora.lora_path, parent=self.base_name)
            for name, lora in self.loras.items()
        ]
        return [base, *adapters]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """Reads and registers an adapter (400 naming what is wrong, nothing registered)."""
        if not self.enable_lora:
            raise ServingError("LoRA adapters need a server started with --enable-lora")
        if body.lora_name in self.loras or body.lora_name == self.base_name:
            raise ServingError(
                f"The lora adapter '{body.lora_name}' has already been loaded", "lora_name"
            )
        lora = LoRARequest(body.lora_name, self._next_id, body.lora_path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as error:  # InvalidRequestError: the adapter's fault
            raise ServingError(str(error), "lora_path") from error
        self._next_id += 1
        self.loras[body.lora_name] = lora
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        lora = self.loras.get(body.lora_name)
        if lora is None:
            raise ServingError(
                f"The lora adapter '{body.lora_name}' cannot be found", "lora_name", 404,
                code="model_not_found",
            )  # fmt: skip
        try:
            await self.engine.remove_lora(lora.lora_int_id)
        except ValueError as error:  # in use by unfinished requests
            raise ServingError(str(error), "lora_name") from error
        del self.loras[body.lora_name]
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
