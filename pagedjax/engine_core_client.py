"""The front end's handle on an engine core in another process (vLLM V1's MPClient): the
in-process core's interface, as `LLMEngine` and `AsyncLLM` use it, over pipes to the process
that `engine_core_proc.py` runs.

Requests are checked here against the limits the core reported at start-up, so a request that
could never run is refused before it is sent. `step()` returns the outputs the core has sent
since the last call (every message waiting, so a front end that falls behind catches up in one
pass), waiting a little for the next one when none has come. The core runs ahead of the front
end: a sequence a stop string ended may still get tokens, which the output processor drops.
Only the thread that runs the engine loop may call it; `stats()`, `is_sleeping()` and the
limits are cached, for any thread.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Sequence

from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.sched_output import CoreOutput
from pagedjax.engine_core_proc import CoreState, run_engine_core, unpack_outputs
from pagedjax.errors import EngineDeadError

# How long `step()` waits for the core's next message before returning none, so the engine
# loop can take new requests meanwhile.
POLL_S = 0.05


class CoreProcessClient:
    """Starts the engine core's process and waits until it has loaded the model."""

    def __init__(self, config: EngineConfig):
        context = multiprocessing.get_context("spawn")  # JAX's runtime does not survive fork
        core_commands, self._commands = context.Pipe(duplex=False)
        self._results, core_results = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_engine_core,
            args=(config, core_commands, core_results),
            name="pagedjax-engine-core",
            daemon=True,
        )
        self._process.start()
        core_commands.close()  # the process holds its ends: they read EOF once it is gone
        core_results.close()
        self._live: set[str] = set()  # user requests sent and not yet reported finished
        self._pending: list[CoreOutput] = []  # received during a call
        self._stats: dict = {}
        self._started = False
        # Whether the core reported itself idle since the last command: until then the
        # engine loop keeps reading, so the core's last statistics (after an abort) arrive.
        self._core_idle = True
        message = self._receive()
        if message[0] != "ready":
            self._process.join(timeout=10)
            raise message[1]  # the core's start-up error (a bad option or model)
        _, info, state, self._stats = message
        self.config, self.model_config, self.limits = info.config, info.model_config, info.limits
        self._state: CoreState = state
        self._started = True

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        # The constraints' host state does not pickle; the core builds them again.
        constraints, request.constraints = request.constraints, None
        try:
            self._send(("add", request))
        finally:
            request.constraints = constraints
        self._live.add(request.group_id)

    def abort_requests(self, group_ids: list[str]) -> None:
        self._send(("abort", list(group_ids)))
        self._live.difference_update(group_ids)

    def finish_sequences(self, sequences: list[tuple[str, int]], status: RequestStatus) -> None:
        self._send(("finish", sequences, status))

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        self.limits.check(num_prompt_tokens, max_tokens, n)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live or self._pending) or not self._core_idle

    def has_step_in_flight(self) -> bool:
        return False  # the core's own business

    @property
    def num_waiting(self) -> int:
        return self._stats.get("waiting", 0)

    @property
    def num_generated_tokens(self) -> int:
        return self._stats.get("num_generated_tokens", 0)

    def stats(self) -> dict:
        return dict(self._stats)

    def step(self) -> list[CoreOutput]:
        """The outputs the core sent since the last call."""
        outputs, self._pending = self._pending, []
        if not outputs and not self._results.poll(POLL_S):
            return outputs
        while self._results.poll():
            message = self._receive()
            if message[0] != "outputs":
                raise EngineDeadError(f"the engine core sent {message[0]!r} out of turn")
            outputs += unpack_outputs(message[1])
        return outputs

    # ------------------------------------------------------------------ calls

    def call(self, name: str, *args: object) -> object:
        """Runs `name` in the core between its steps; raises its error. The outputs that
        come meanwhile are returned by the next `step()`."""
        self._send(("call", name, args))
        while True:
            message = self._receive()
            if message[0] == "outputs":
                self._pending += unpack_outputs(message[1])
                continue
            _, value, error, self._state = message
            self._core_idle = self._state.idle
            if error is not None:
                raise error
            return value

    def update_weights(self, params: object) -> None:
        self.call("update_weights", params)

    def sleep(self, level: int) -> None:
        self.call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None) -> None:
        self.call("wake_up", tags)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call("reset_prefix_cache"))

    def warmup(self) -> float:
        return float(self.call("warmup"))

    def is_sleeping(self) -> bool:
        return self._state.is_sleeping

    def has_weights(self) -> bool:
        return self._state.has_weights

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the core's process (after its step in progress)."""
        if self._process.is_alive():
            with contextlib.suppress(EngineDeadError):
                self._send(("shutdown",))
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    # ------------------------------------------------------------------ pipes

    def _send(self, message: tuple) -> None:
        self._core_idle = False
        try:
            self._commands.send(message)
        except OSError as error:
            raise EngineDeadError(self._exit_text()) from error

    def _receive(self) -> tuple:
        """The core's next message; its "outputs" update what is unfinished and the
        statistics, its death raises EngineDeadError (at start-up, its error)."""
        try:
            message = self._results.recv()
        except (EOFError, OSError) as error:
            self._process.join(timeout=5)
            raise EngineDeadError(self._exit_text()) from error
        kind = message[0]
        if kind == "outputs":
            self._live.difference_update(message[2])
            self._stats, self._core_idle = message[3], message[4]
        elif kind == "dead" and self._started:
            raise EngineDeadError(f"the engine core stopped: {message[1]!r}") from message[1]
        return message

    def _exit_text(self) -> str:
        code = self._process.exitcode
        return (
            f"the engine core's process exited (code {code})"
            if code is not None
            else ("the engine core's process stopped answering")
        )
