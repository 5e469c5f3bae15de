"""Many hosts: `jax.distributed` joins the processes; one schedules, all run the same steps.

JAX runs a mesh that spans hosts as one program per process (multi-controller): every
process must call the same jitted functions, in the same order, on the same global arrays.
Process 0, the leader, runs the whole engine (scheduler, KV cache manager, output
processor). Before each call that runs on the devices (a step, a warmup, a pool reset) its
worker broadcasts the call's host inputs to the other processes, the followers, whose
engines hold the same workers (weights and KV pool shards on their own devices) and make the
same call. A broadcast is `multihost_utils.broadcast_one_to_all` of the pickled inputs: a
collective over every device, so the followers also keep step with the leader.

With `LLM`, every process runs the same script: a follower's `generate` runs the leader's
steps until the leader's `generate` returns, and returns the same outputs. With
`pagedjax serve`, followers follow until the leader's server stops.

The processes are named by `coordinator_address` (process 0's host:port), `num_processes`
and `process_id`, from the engine options or PAGEDJAX_COORDINATOR_ADDRESS,
PAGEDJAX_NUM_PROCESSES and PAGEDJAX_PROCESS_ID; a script that calls
`jax.distributed.initialize` itself needs none of them.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

ENVIRONMENT = {
    "coordinator_address": "PAGEDJAX_COORDINATOR_ADDRESS",
    "num_processes": "PAGEDJAX_NUM_PROCESSES",
    "process_id": "PAGEDJAX_PROCESS_ID",
}
# Payloads are padded to a power of two of at least this many bytes: one compiled broadcast
# per size.
MIN_PAYLOAD = 1 << 10


def joins_processes(coordinator_address: str | None) -> bool:
    """Whether the engine is to join other processes (an address given, or in the
    environment) or has joined them already."""
    address = coordinator_address or os.environ.get(ENVIRONMENT["coordinator_address"])
    return address is not None or jax.distributed.is_initialized()


def initialize(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Joins this process to the others with `jax.distributed.initialize` (the arguments,
    else the environment); does nothing for one process or when JAX is joined already.
    Must run before JAX touches a device."""
    env = {name: os.environ.get(var) for name, var in ENVIRONMENT.items()}
    coordinator_address = coordinator_address or env["coordinator_address"]
    if num_processes is None and env["num_processes"]:
        num_processes = int(env["num_processes"])
    if process_id is None and env["process_id"]:
        process_id = int(env["process_id"])
    if jax.distributed.is_initialized() or coordinator_address is None:
        return
    if num_processes is None or process_id is None:
        raise ValueError(
            "a coordinator_address needs num_processes and process_id too (options, or "
            "PAGEDJAX_NUM_PROCESSES and PAGEDJAX_PROCESS_ID)"
        )
    # CPU processes exchange collectives over gloo; a GPU's go over NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    logger.info(
        "process %d of %d joined %s: %d devices in all, %d here",
        process_id,
        num_processes,
        coordinator_address,
        jax.device_count(),
        jax.local_device_count(),
    )


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """The leader's messages to every follower, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.is_leader = is_leader()

    def send(self, message: Any) -> None:
        """Leader: broadcasts a picklable message."""
        assert self.is_leader, "only process 0 sends"
        self._broadcast(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self) -> Any:
        """Follower: the leader's next message (blocks until it is sent)."""
        assert not self.is_leader, "process 0 sends, the others receive"
        return pickle.loads(self._broadcast(b""))

    def share(self, value: Any) -> Any:
        """The leader's `value` on every process (the leader's own on the leader)."""
        if self.is_leader:
            self.send(value)
            return value
        return self.receive()

    def _broadcast(self, payload: bytes) -> bytes:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        size = int(broadcast_one_to_all(np.array([len(payload)], np.int64))[0])
        padded = np.zeros(max(MIN_PAYLOAD, 1 << (size - 1).bit_length()), np.uint8)
        padded[: len(payload)] = np.frombuffer(payload, np.uint8)
        return np.asarray(broadcast_one_to_all(padded))[:size].tobytes()
