"""Errors the engine raises for requests it refuses. Each is raised before any state changes,
so the engine keeps serving everyone else. All are ValueErrors, as in vLLM."""


class InvalidRequestError(ValueError):
    """A request the engine cannot take as given (empty prompt, token ids outside the
    vocabulary or not ints); the message says what to change."""


class DuplicateRequestIdError(InvalidRequestError):
    """The request id is in use by an unfinished request."""


class RequestTooLongError(InvalidRequestError):
    """The request can never be scheduled: it exceeds max_model_len or the whole KV pool."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its limit (`max_waiting_requests`): retry later. A
    server answers 503."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped and serves nothing more; the message holds its cause. Restart
    the engine (a server's /health reports it)."""


class EngineSleepingError(RuntimeError):
    """The engine's device memory is given back (`LLM.sleep`): wake it up first."""
