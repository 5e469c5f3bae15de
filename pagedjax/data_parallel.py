"""Data parallelism: D engine replicas behind one engine, and which devices each one runs on.

Each replica is a whole `EngineCore` (scheduler, KV cache manager, worker with its own KV
pool) on its own `tensor_parallel_size` devices; `DataParallelCore` has the engine core's
interface, so `LLMEngine`, `LLM` and `AsyncLLM` run over it unchanged. A new request goes to
the replica whose prefix cache, or whose recent requests, share the longest prefix with its
prompt, among the replicas whose load (running plus waiting sequences) is within `slack` of
the least loaded; otherwise to the least loaded. A step steps every busy replica: each
dispatches its next step before waiting for its previous one, so all replicas' devices work
at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import jax

from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.hashing import BlockHash, hash_request_tokens, request_extra_keys
from pagedjax.core.sched_output import CoreOutput, ended_groups
from pagedjax.core.scheduler import RequestLimits
from pagedjax.core.spec_decode import SpecDecodeStats
from pagedjax.engine_core import EngineCore

# Block hashes of recently routed prompts remembered for affinity: a prompt sharing a prefix
# with one still waiting goes where that one went, before either is cached.
MAX_ROUTED_BLOCKS = 1 << 16


def replica_devices(config: EngineConfig) -> list[tuple[jax.Device, ...]] | None:
    """Each replica's devices (`tensor_parallel_size` consecutive devices of
    `jax.devices()` per replica); None for one replica on one device (JAX's default).
    Raises ValueError when there are too few devices."""
    size, replicas = config.tensor_parallel_size, config.data_parallel_size
    devices = jax.devices()
    if jax.process_count() > 1 and (replicas > 1 or size != len(devices)):
        raise ValueError(
            f"over {jax.process_count()} processes, one tensor-parallel group spans all "
            f"{len(devices)} devices: set tensor_parallel_size={len(devices)} and "
            "data_parallel_size=1"
        )
    if size == 1 and replicas == 1:
        return None
    needed = size * replicas
    if needed > len(devices):
        hint = ""
        if devices[0].platform == "cpu":
            hint = (
                "; on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before "
                "JAX starts) makes N devices"
            )
        raise ValueError(
            f"tensor_parallel_size {size} x data_parallel_size {replicas} needs {needed} "
            f"devices; JAX sees {len(devices)} ({devices[0].platform}){hint}"
        )
    return [tuple(devices[r * size : (r + 1) * size]) for r in range(replicas)]


class DataParallelCore:
    """D engine cores as one: routes requests, steps them all, sums their statistics."""

    def __init__(self, cores: Sequence[EngineCore], slack: int | None = None):
        """slack: how many more sequences than the least loaded replica a replica may run
        and still win a request by prefix affinity (default max_num_seqs // 4, at least 1)."""
        self.cores = list(cores)
        self.config = self.cores[0].config
        self.slack = max(1, self.config.max_num_seqs // 4) if slack is None else slack
        self._replica_of: dict[str, int] = {}  # unfinished request id -> its replica
        self._routed: OrderedDict[BlockHash, int] = OrderedDict()

    # ------------------------------------------------------------------ routing

    def load(self, replica: int) -> int:
        """Unfinished sequences (running and waiting) of a replica."""
        return self.cores[replica].num_unfinished_sequences()

    def choose_replica(self, request: EngineRequest, hashes: list[BlockHash] | None = None) -> int:
        """The replica for a new request (see the module docstring); `hashes`: its prompt's
        block hashes, if computed already."""
        loads = [self.load(r) for r in range(len(self.cores))]
        least = min(loads)
        if hashes is None:
            hashes = self._prompt_hashes(request)
        best, best_key = 0, None
        for replica, load in enumerate(loads):
            affinity = self._shared_blocks(replica, hashes) if load <= least + self.slack else 0
            key = (-affinity, load, replica)
            if best_key is None or key < best_key:
                best, best_key = replica, key
        return best

    def _prompt_hashes(self, request: EngineRequest) -> list[BlockHash]:
        if not self.config.enable_prefix_caching or request.skip_prefix_cache:
            return []
        return hash_request_tokens(
            request.prompt_token_ids, self.config.block_size, request_extra_keys(request)
        )

    def _shared_blocks(self, replica: int, hashes: list[BlockHash]) -> int:
        """Leading prompt blocks the replica has cached or was recently sent."""
        cached = self.cores[replica].kv_cache_manager.num_cached_prefix_blocks(hashes)
        routed = cached
        while routed < len(hashes) and self._routed.get(hashes[routed]) == replica:
            routed += 1
        return routed

    def _remember(self, replica: int, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            self._routed[block_hash] = replica
            self._routed.move_to_end(block_hash)
        while len(self._routed) > MAX_ROUTED_BLOCKS:
            self._routed.popitem(last=False)

    # ------------------------------------------------------- the engine core's API

    def add_request(self, request: EngineRequest) -> None:
        hashes = self._prompt_hashes(request)
        replica = self.choose_replica(request, hashes)
        self.cores[replica].add_request(request)
        self._replica_of[request.request_id] = replica
        self._remember(replica, hashes)

    def fork_request(self, parent: EngineRequest, child: EngineRequest) -> None:
        replica = self._replica_of[parent.group_id]  # the child lives beside its blocks
        self.cores[replica].fork_request(parent, child)
        self._replica_of[child.group_id] = replica

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        self.cores[0].check_fits(num_prompt_tokens, max_tokens, n)  # replicas are alike

    def request_limits(self) -> RequestLimits:
        return self.cores[0].request_limits()

    def has_request(self, group_id: str) -> bool:
        replica = self._replica_of.get(group_id)
        return replica is not None and self.cores[replica].has_request(group_id)

    def abort_requests(self, group_ids: list[str]) -> None:
        for group_id in group_ids:
            replica = self._replica_of.pop(group_id, None)
            if replica is not None:
                self.cores[replica].abort_requests([group_id])

    def finish_sequences(self, sequences: list[tuple[str, int]], status: RequestStatus) -> None:
        for group_id, index in sequences:
            replica = self._replica_of.get(group_id)
            if replica is not None:
                self.cores[replica].finish_sequences([(group_id, index)], status)
                self._forget_if_finished(group_id)

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def num_unfinished_sequences(self) -> int:
        return sum(core.num_unfinished_sequences() for core in self.cores)

    @property
    def num_waiting(self) -> int:
        return sum(core.num_waiting for core in self.cores)

    def step(self) -> list[CoreOutput]:
        outputs = []
        for core in self.cores:
            if core.has_unfinished_requests() or core.has_step_in_flight():
                outputs += core.step()
        # Only a request with a sequence that ended this step can have finished.
        for group_id in ended_groups(outputs):
            self._forget_if_finished(group_id)
        return outputs

    def _forget_if_finished(self, group_id: str) -> None:
        replica = self._replica_of.get(group_id)
        if replica is not None and group_id not in self.cores[replica].scheduler.requests:
            del self._replica_of[group_id]

    def has_step_in_flight(self) -> bool:
        return any(core.has_step_in_flight() for core in self.cores)

    def reset_prefix_cache(self) -> bool:
        if self.has_unfinished_requests() or self.has_step_in_flight():
            return False
        self._routed.clear()
        return all(core.reset_prefix_cache() for core in self.cores)

    def warmup(self) -> float:
        return sum(core.warmup() for core in self.cores)

    @property
    def num_steps(self) -> int:
        return max(core.num_steps for core in self.cores)

    @property
    def num_generated_tokens(self) -> int:
        return sum(core.num_generated_tokens for core in self.cores)

    def stats(self) -> dict:
        """The replicas' statistics summed (rates and usage over the whole), and each
        replica's own under "replicas"."""
        per_replica = [core.stats() for core in self.cores]
        total = {}
        for key in per_replica[0]:
            values = [s[key] for s in per_replica]
            if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
                total[key] = max(values) if key.endswith("_per_device") else sum(values)
        total["kv_usage"] = total["kv_blocks_used"] / max(total["kv_blocks_total"], 1)
        hits = [core.kv_cache_manager.prefix_cache_stats for core in self.cores]
        queries = sum(h.queries for h in hits)
        total["prefix_cache_hit_rate"] = sum(h.hits for h in hits) / queries if queries else 0.0
        host = sum(h.host_hits for h in hits)
        total["prefix_cache_host_hit_rate"] = host / queries if queries else 0.0
        spec = SpecDecodeStats()
        for core in self.cores:
            for name, value in vars(core.scheduler.spec_stats).items():
                setattr(spec, name, getattr(spec, name) + value)
        total.update(spec.as_dict())  # the rates over the whole, not summed
        total["replicas"] = per_replica
        return total
