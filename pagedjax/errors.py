"""Errors the engine raises for requests it refuses. Each is raised before any state changes,
so the engine keeps serving everyone else. All are ValueErrors, as in vLLM."""


class InvalidRequestError(ValueError):
    """A request the engine cannot take as given (empty prompt, token ids outside the
    vocabulary or not ints); the message says what to change."""


class DuplicateRequestIdError(InvalidRequestError):
    """The request id is in use by an unfinished request."""


class RequestTooLongError(InvalidRequestError):
    """The request can never be scheduled: it exceeds max_model_len or the whole KV pool."""
