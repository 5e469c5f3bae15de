"""Errors raised by the KV cache manager when it is used in a way it cannot honour.

Each message names what went wrong and what the caller should do instead. Running out of
free blocks is *not* an error: `allocate_slots` returns None so the scheduler can preempt.
"""


class KVCacheError(Exception):
    """Base class for misuse of the block pool or the KV cache manager."""


class UnknownRequestError(KVCacheError):
    """The manager holds no state for this request id."""


class DuplicateRequestError(KVCacheError):
    """A request id is registered twice (e.g. forking into an id that is already live)."""


class InvalidAllocationError(KVCacheError, ValueError):
    """An allocation call whose arguments contradict the request's state."""


class PrefixCacheInUseError(KVCacheError):
    """`reset_prefix_cache()` was called while some blocks are still held by requests."""
