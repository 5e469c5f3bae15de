"""The worker's LoRA adapters: a host cache of packed adapters and the device's slots.

`max_loras` device slots (`models/lora.py`: slot 0 is the base) hold the adapters a step runs;
an adapter a step needs and no slot holds takes a free slot, or the least recently used one
this step does not need (the scheduler admits at most `max_loras` adapters at once). Packed
adapters wait on the host, `max_cpu_loras` of them, least recently used dropped first and
read from their path again when needed (one added from memory stays). Writing a slot is one
jitted update of the donated slots: no step recompiles.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import jax
import numpy as np

from models.config import ModelConfig
from models.lora import empty_lora, set_slot_jit, slot_rank
from models.peft import LoRAAdapter, check_adapter, load_peft_adapter, pack_adapter
from pagedjax.errors import InvalidRequestError
from pagedjax.lora.request import LoRARequest

Packed = dict[str, dict[str, np.ndarray]]


class LoRASlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype,
        place: Callable[[dict], dict] = lambda tree: tree,
        layout: Callable[[Packed], Packed] = lambda packed: packed,
        slot_config: ModelConfig | None = None,
    ):
        """place: puts slots where the step runs (a device, or split over a group); layout:
        a packed adapter as the step's weights are laid out (tensor parallelism's columns);
        slot_config: the model as the slots' shapes see it (default `config`)."""
        self.config, self.max_rank, self.max_cpu_loras = config, max_rank, max_cpu_loras
        self.weights = place(empty_lora(slot_config or config, max_loras, max_rank, dtype))
        self._layout = layout
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free_slots = list(range(max_loras, 0, -1))  # popped from the end: slot 1 first
        self._host: OrderedDict[int, Packed] = OrderedDict()  # LRU first
        self._requests: dict[int, LoRARequest] = {}  # every adapter added, by id
        self._in_memory: set[int] = set()  # added as arrays: never dropped from the host
        self.num_loads = 0  # adapters written into a slot (a measure of churn)

    # ------------------------------------------------------------------ adapters

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Registers an adapter: given (checked by the engine's front end), or read from its
        path now and checked, so a bad one fails here; the same id again replaces its weights
        (in its slot too, if loaded)."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_name != request.lora_name:
            raise InvalidRequestError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} already; "
                f"give {request.lora_name!r} an id of its own"
            )
        if adapter is None and not request.lora_path:
            raise InvalidRequestError(
                f"adapter {request.lora_name!r} has no lora_path and was not added with add_lora"
            )
        packed = self._read(request) if adapter is None else self._pack(adapter)
        self._requests[request.lora_int_id] = request
        if not request.lora_path:
            self._in_memory.add(request.lora_int_id)
        self._keep(request.lora_int_id, packed)
        slot = self._slot_of.get(request.lora_int_id)
        if slot is not None:  # new weights for a loaded adapter: in place
            self._write(slot, packed)

    def remove(self, lora_id: int) -> bool:
        """Forgets an adapter (its slot cleared for reuse); False if unknown."""
        if self._requests.pop(lora_id, None) is None:
            return False
        self._host.pop(lora_id, None)
        self._in_memory.discard(lora_id)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return True

    def known(self, lora_id: int) -> bool:
        return lora_id in self._requests

    def list_loras(self) -> list[LoRARequest]:
        return list(self._requests.values())

    # --------------------------------------------------------------------- slots

    def activate(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Each adapter's slot for a step that runs these (0 for the base), loading those no
        slot holds; ValueError for more than max_loras at once."""
        wanted = {lora_id for lora_id in lora_ids if lora_id}
        slots = {0: 0}
        for lora_id in wanted:
            slot = self._slot_of.get(lora_id)
            if slot is None:
                slot = self._take_slot(wanted)
                self._write(slot, self._packed(lora_id))
                self._slot_of[lora_id] = slot
                self.num_loads += 1
            self._slot_of.move_to_end(lora_id)
            slots[lora_id] = slot
        return slots

    def _take_slot(self, wanted: set[int]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((i for i in self._slot_of if i not in wanted), None)
        if victim is None:
            raise ValueError(f"a step runs more adapters than max_loras={len(self._slot_of)}")
        return self._slot_of.pop(victim)

    def _packed(self, lora_id: int) -> Packed:
        packed = self._host.get(lora_id)
        if packed is None:  # dropped from the host cache: read again
            packed = self._read(self._requests[lora_id])
        self._keep(lora_id, packed)
        return packed

    def _read(self, request: LoRARequest) -> Packed:
        adapter = load_peft_adapter(request.lora_path)
        check_adapter(adapter, self.config, self.max_rank)
        return self._pack(adapter)

    def _pack(self, adapter: LoRAAdapter) -> Packed:
        return pack_adapter(adapter, self.config, slot_rank(self.max_rank))

    def _keep(self, lora_id: int, packed: Packed) -> None:
        self._host[lora_id] = packed
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            dropped = next((i for i in self._host if i not in self._in_memory), None)
            if dropped is None or dropped == lora_id:
                break
            del self._host[dropped]

    def _write(self, slot: int, packed: Packed) -> None:
        # Host arrays: the jitted write moves each to where its slots are (split or not).
        update = jax.tree.map(np.asarray, self._layout(packed))
        self.weights = set_slot_jit(self.weights, np.int32(slot), update)
