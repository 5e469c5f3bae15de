"""AsyncLLM: the engine on a thread of its own, serving many concurrent callers (vLLM's AsyncLLM).

Callers (coroutines on any event loop) tokenize and validate their request on their own
thread, so a bad request raises before the engine sees it, then hand it to the engine loop
through a queue. The loop adds and aborts requests between steps, steps while anything is
unfinished, and sends each output to its caller's event loop. Requests that arrive together
run in the same steps; a caller that stops listening aborts its request.

The loop never dies silently: a failed step fails only its requests (`EngineCore`); anything
else that stops the loop is kept in `dead_error` and raised to every caller, present and
future, as `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field

from models.llama import Params
from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest
from pagedjax.engine import LLMEngine
from pagedjax.errors import DuplicateRequestIdError, EngineDeadError, QueueFullError
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: a queue on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request: EngineRequest
    prompt_text: str | None
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """A call on the engine between steps (new weights, sleep); its outputs go to the
    streams, its result or error to `future` on the caller's loop."""

    fn: Callable[[], list[RequestOutput] | None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class _Shutdown:
    pass


class AsyncLLM:
    """`AsyncLLM(model=None, *, max_waiting_requests=None, **engine_options)`.

    `max_waiting_requests`: requests not yet running beyond which `generate` raises
    `QueueFullError` (a server's 503); None: no limit. `core_process`: the engine core in a
    process of its own (as `pagedjax serve` runs it), this one keeping the loop, the
    tokenizer and the detokenizer.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_waiting_requests: int | None = None,
        engine: LLMEngine | None = None,
        core_process: bool = False,
        **engine_options,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1: {max_waiting_requests}")
        self.engine = engine or LLMEngine(
            EngineConfig.from_options(model, **engine_options), core_process=core_process
        )
        self.config = self.engine.config
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the two fields below, shared by callers
        self._active: set[str] = set()  # request ids with a live `generate`
        self._num_pending_adds = 0  # handed to the loop, not yet in the scheduler
        self._num_waiting = 0  # the scheduler's waiting queue, as of the loop's last pass
        self._stats: dict = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.dead_error!r}")

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs as its `output_kind` asks, the last one finished
        (lora_request: its LoRA adapter, as `LLMEngine.add_request`).

        Raises before any output: a ValueError (`InvalidRequestError`) for bad input,
        `QueueFullError` at the waiting limit, `EngineDeadError` if the loop stopped.
        Closing or cancelling the generator aborts the request.
        """
        self._check_alive()
        if request_id is None:
            raise ValueError("generate needs a request_id")
        request, prompt_text = self.engine.process_request(
            request_id, prompt, sampling_params, priority, lora_request=lora_request
        )
        with self._lock:
            if request_id in self._active:
                raise DuplicateRequestIdError(
                    f"request id {request_id!r} is already in use; pick a new one"
                )
            limit = self.max_waiting_requests
            if limit is not None and self._num_pending_adds + self._num_waiting >= limit:
                raise QueueFullError(
                    f"{limit} requests are already waiting (max_waiting_requests); retry later"
                )
            self._active.add(request_id)
            self._num_pending_adds += 1
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request, prompt_text, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the loop dropped it already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
            with self._lock:
                self._active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request: its blocks are freed before the next step and its `generate`
        ends with a final output whose finish reason is "abort"."""
        self._commands.put(_Abort(request_id))

    # ------------------------------------------------------------ weights in and out

    async def _call(self, fn: Callable[[], list[RequestOutput] | None]) -> None:
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Call(fn, loop, future))
        await future

    async def update_weights(self, params: Params | Mapping[str, object]) -> None:
        """New weights between steps (`pagedjax/weight_sync.py`); running requests go on,
        recomputed on them."""
        await self._call(lambda: self.engine.update_weights(params))

    async def sleep(self, level: int = 1) -> None:
        """Gives the device memory back; only while no request is unfinished."""
        await self._call(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda: self.engine.wake_up(tags))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers a LoRA adapter between steps (`LLMEngine.add_lora`)."""
        await self._call(lambda: self.engine.add_lora(lora_request) and None)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter between steps; False if unknown (`LLMEngine.remove_lora`)."""
        removed: list[bool] = []
        await self._call(lambda: removed.append(self.engine.remove_lora(lora_id)))
        return removed[0]

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def stats(self) -> dict:
        """The engine's statistics as of the loop's last pass (safe from any thread)."""
        return dict(self._stats)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the loop (after the step in progress); every open `generate` raises
        `EngineDeadError`."""
        if self._thread.is_alive():
            self._commands.put(_Shutdown())
            self._thread.join(timeout)
        self.engine.shutdown()  # other hosts' processes stop following; a core process ends

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        streams: dict[str, _Stream] = {}
        try:
            while self._serve_commands(streams):
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Before the outputs: a caller that sees its request finish sees its blocks freed.
                self._publish_stats()
                self._send(streams, outputs)
        except BaseException as error:  # noqa: BLE001  (kept and raised to every caller)
            logger.exception("the engine loop stopped")
            self.dead_error = error
        else:
            self.dead_error = EngineDeadError("the engine was shut down")
        dead = EngineDeadError(f"the engine loop stopped: {self.dead_error!r}")
        for stream in streams.values():
            stream.put(dead)
        while True:  # requests handed over after the loop stopped
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                command.stream.put(dead)

    def _serve_commands(self, streams: dict[str, _Stream]) -> bool:
        """Applies the queued adds and aborts; waits for one while the engine is idle.
        Returns False on shutdown."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Shutdown):
                return False
            if isinstance(command, _Add):
                self._add(streams, command)
            elif isinstance(command, _Call):
                self._run_call(streams, command)
            elif isinstance(command, _Abort):
                stream = streams.pop(command.request_id, None)
                for output in self.engine.abort_request(command.request_id):
                    if stream is not None:
                        stream.put(output)

    def _run_call(self, streams: dict[str, _Stream], command: _Call) -> None:
        def settle(future: asyncio.Future, error: BaseException | None) -> None:
            if future.done():  # the caller was cancelled
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        error = None
        try:
            self._send(streams, command.fn() or [])
        except Exception as e:  # noqa: BLE001  (the caller gets it, the loop goes on)
            error = e
        command.loop.call_soon_threadsafe(settle, command.future, error)

    def _add(self, streams: dict[str, _Stream], command: _Add) -> None:
        request = command.request
        try:
            self.engine.add_processed_request(request, command.prompt_text)
        except Exception as error:  # noqa: BLE001  (the caller gets it, the loop goes on)
            command.stream.put(error)
        else:
            streams[request.request_id] = command.stream
        finally:
            with self._lock:
                self._num_pending_adds -= 1
                self._num_waiting = self.engine.engine_core.num_waiting

    def _send(self, streams: dict[str, _Stream], outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del streams[output.request_id]
            stream.put(output)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._num_waiting = stats["waiting"]
        self._stats = stats
