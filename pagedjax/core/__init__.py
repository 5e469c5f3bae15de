"""Host-side engine core: KV block pool, prefix cache and the KV cache manager (no JAX)."""

from pagedjax.core.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock
from pagedjax.core.errors import (
    DuplicateRequestError,
    InvalidAllocationError,
    KVCacheError,
    PrefixCacheInUseError,
    UnknownRequestError,
)
from pagedjax.core.hashing import BlockHash, hash_block_tokens, hash_request_tokens
from pagedjax.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedjax.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedjax.core.memory import KVCacheSpec, MemoryLedger, dtype_itemsize
from pagedjax.core.request import KVCacheRequest, Request

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "DuplicateRequestError",
    "FreeBlockQueue",
    "HybridKVCacheManager",
    "InvalidAllocationError",
    "KVCacheBlock",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheRequest",
    "KVCacheSpec",
    "MemoryLedger",
    "PrefixCacheInUseError",
    "PrefixCacheStats",
    "Request",
    "UnknownRequestError",
    "dtype_itemsize",
    "hash_block_tokens",
    "hash_request_tokens",
]
