"""The engine core in a process of its own (vLLM V1's EngineCoreProc), so that HTTP handling,
tokenization and detokenization in the front end never hold the interpreter lock that
scheduling and dispatching need.

The process builds the engine (model, KV pool, scheduler) and loops: apply the front end's
commands (requests added or aborted, sequences a stop string ended, calls such as warmup or new
weights), step while anything is unfinished, and send each step's `EngineCoreOutput`s back with
the user requests it no longer holds. A thread of its own pickles and sends, so a step never
waits for the front end to read. The front end's side is `engine_core_client.py`.

Messages are tuples over two one-way pipes. Front end to core: ("add", EngineRequest),
("abort", ids), ("finish", [(id, index)], status), ("call", name, args), ("shutdown",).
Core to front end: ("ready", CoreInfo, CoreState, stats) or ("dead", error) once; then
("outputs", packed outputs, finished ids, stats, idle) and, for each call, ("result", value,
error, CoreState). Every command gets an answer once the core is idle, with its statistics.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from models.config import ModelConfig
from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.sched_output import CoreOutput, DecodeOutputs, EngineCoreOutput, ended_groups
from pagedjax.core.scheduler import RequestLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs from a started core."""

    config: EngineConfig  # as the workers resolved it ("auto" options decided)
    model_config: ModelConfig
    limits: RequestLimits  # what every request must fit in, checked before it is sent


@dataclass(frozen=True)
class CoreState:
    """The core's state after a call, which the front end checks without asking."""

    is_sleeping: bool
    has_weights: bool
    idle: bool  # nothing unfinished


def pack_outputs(outputs: list[CoreOutput]) -> list:
    """The outputs as tuples, which pickle ten times faster than slotted dataclasses; a
    decode step's plain new token as three fields (a steady step's rows: one object)."""
    return [
        o
        if isinstance(o, DecodeOutputs)
        else (o.request_id, o.index, o.new_token_ids)
        if o.status is None
        and o.logprobs is None
        and o.prompt_logprobs is None
        and o.num_cached_tokens is None
        else (
            o.request_id,
            o.index,
            o.new_token_ids,
            o.logprobs,
            o.logprobs_row,
            o.status,
            o.stop_reason,
            o.prompt_logprobs,
            o.prompt_logprobs_rows,
            o.num_cached_tokens,
        )
        for o in outputs
    ]


def unpack_outputs(packed: list) -> list[CoreOutput]:
    return [o if isinstance(o, DecodeOutputs) else EngineCoreOutput(*o) for o in packed]


def portable_error(error: BaseException) -> BaseException:
    """The error itself when it pickles, else a RuntimeError with its text."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001  (any pickling failure: send its text instead)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def run_engine_core(config: EngineConfig, commands: Connection, results: Connection) -> None:
    """The process's entry point: builds the engine and serves the front end until it
    shuts down or goes away."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pagedjax.engine import LLMEngine  # imports JAX: here, not in the front end

    try:
        engine = LLMEngine(config)
        state = CoreState(engine.is_sleeping(), engine.has_weights(), idle=True)
        info = CoreInfo(engine.config, engine.model_config, engine.engine_core.request_limits())
    except BaseException as error:  # noqa: BLE001  (the front end raises it)
        results.send(("dead", portable_error(error)))
        return
    results.send(("ready", info, state, engine.stats()))
    _CoreLoop(engine, commands, results).run()


class _CoreLoop:
    def __init__(self, engine, commands: Connection, results: Connection):
        self.engine = engine
        self.core = engine.engine_core
        self.commands, self.results = commands, results
        self.live: set[str] = set()  # user requests added and not yet reported finished
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        sender = threading.Thread(target=self._send_loop, name="pagedjax-core-out", daemon=True)
        sender.start()
        try:
            while self._serve_commands():
                if self.core.has_unfinished_requests():
                    self._emit(self.core.step())
        except (EOFError, OSError):  # the front end went away
            pass
        except BaseException as error:  # noqa: BLE001  (the front end raises it)
            logger.exception("the engine core stopped")
            self._outbox.put(("dead", portable_error(error)))
        finally:
            self._outbox.put(None)
            sender.join(timeout=10)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.results.send(message)
            except OSError:  # the front end went away; the main loop sees it too
                return

    def _serve_commands(self) -> bool:
        """Applies every queued command; waits for one while nothing is unfinished. Returns
        False on shutdown."""
        while not self.core.has_unfinished_requests() or self.commands.poll():
            message = self.commands.recv()
            kind = message[0]
            if kind == "add":
                self._add(message[1])
            elif kind == "abort":
                self.core.abort_requests(message[1])
                self.live.difference_update(message[1])
                self._emit([])  # the statistics (and whether the core is idle now)
            elif kind == "finish":
                self.core.finish_sequences(message[1], message[2])
                self._emit([], touched=[group_id for group_id, _ in message[1]])
            elif kind == "call":
                self._call(message[1], message[2])
            elif kind == "shutdown":
                return False
        return True

    def _add(self, request: EngineRequest) -> None:
        self.live.add(request.group_id)
        try:
            # The constraints' host state (a compiled grammar) does not pickle: built again.
            request.constraints = self.engine.constraints.build(request.params)
            self.core.add_request(request)
        except Exception:  # noqa: BLE001  (the front end checked it: a bug, reported as such)
            logger.exception("could not add request %s", request.request_id)
            self._emit([EngineCoreOutput(request.group_id, 0, status=RequestStatus.FINISHED_ERROR)])

    def _call(self, name: str, args: tuple) -> None:
        engine, value, error = self.engine, None, None
        try:
            if name == "update_weights":
                self._emit(engine.update_core_weights(*args))
            elif name == "warmup":
                value = self.core.warmup()
            elif name in ("sleep", "wake_up", "reset_prefix_cache"):
                value = getattr(engine, name)(*args)
            else:
                raise ValueError(f"the engine core has no call {name!r}")
        except Exception as e:  # noqa: BLE001  (the caller gets it, the loop goes on)
            error = portable_error(e)
        idle = not self.core.has_unfinished_requests()
        state = CoreState(engine.is_sleeping(), engine.has_weights(), idle)
        self._outbox.put(("result", value, error, state))

    def _emit(self, outputs: list[CoreOutput], touched: list[str] = ()) -> None:
        """Sends a step's outputs with the user requests now finished and the statistics."""
        ended = ended_groups(outputs)
        ended.update(touched)
        finished = [g for g in ended if g in self.live and not self.core.has_request(g)]
        self.live.difference_update(finished)
        idle = not self.core.has_unfinished_requests()
        # The statistics every time: they cost microseconds, and /metrics stays exact.
        message = ("outputs", pack_outputs(outputs), finished, self.core.stats(), idle)
        self._outbox.put(message)
