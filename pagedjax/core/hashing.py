"""Content keys for full KV blocks, the lookup keys of the prefix cache.

A block's key is a chained sha256 over (parent block's key, the block's token ids, extra
keys). Chaining makes the key depend on the whole prefix, so equal keys mean equal KV content
(sha256 collisions are not a practical concern, so a hit is trusted without re-reading
tokens). The byte encoding is fixed-width and explicit, never Python's `hash()` or `pickle`,
so keys are stable across processes, machines and Python versions.

Extra keys carry request inputs that change the KV content of the same tokens: a cache salt,
a LoRA adapter's id and the version of its weights (an adapter replaced in place is another).
To add one, add its attribute name to `EXTRA_KEY_FIELDS`.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = bytes
"""32-byte sha256 digest identifying a full block and everything before it."""

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedjax/kv-block-hash/v1").digest()
"""Parent key of a request's first block (a fixed seed, so the first block chains too)."""

EXTRA_KEY_FIELDS: tuple[str, ...] = ("cache_salt", "lora_id", "lora_version")
"""Request attributes that, when present and not None, enter every block key."""

_BLOCK_LEN = struct.Struct("<I")


@functools.lru_cache(maxsize=256)  # token counts vary (whole prompts): keep the cache bounded
def _int64_packer(num_tokens: int) -> Callable[..., bytes]:
    """Packs `num_tokens` token ids as little-endian int64: fixed width, so together with
    the length prefix the encoding is injective."""
    return struct.Struct(f"<{num_tokens}q").pack


def encode_extra_keys(keys: Sequence[Any]) -> bytes:
    """Canonical, self-delimiting bytes for extra keys (None, bool, int, str, bytes, tuples)."""
    out = bytearray()
    for key in keys:
        _encode_key(key, out)
    return bytes(out)


def _encode_key(key: Any, out: bytearray) -> None:
    if key is None:
        out += b"N"
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        digits = str(key).encode()
        out += b"i" + struct.pack("<I", len(digits)) + digits
    elif isinstance(key, str):
        data = key.encode("utf-8")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(key, (bytes, bytearray)):
        out += b"b" + struct.pack("<I", len(key)) + bytes(key)
    elif isinstance(key, (tuple, list)):
        out += b"(" + struct.pack("<I", len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(
            f"extra cache key of type {type(key).__name__} has no stable encoding; "
            "use None, bool, int, str, bytes or tuples of those"
        )


def request_extra_keys(request: Any) -> bytes:
    """Encoded extra keys of a request: (field name, value) for each set `EXTRA_KEY_FIELDS`."""
    keys = []
    for name in EXTRA_KEY_FIELDS:
        value = getattr(request, name, None)
        if value is not None:
            keys.append((name, value))
    return encode_extra_keys(keys)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Key of one full block given its parent's key (None for the first block)."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    packed = _BLOCK_LEN.pack(len(token_ids)) + _int64_packer(len(token_ids))(*token_ids)
    return hashlib.sha256(parent + packed + extra_keys).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: bytes = b"",
    max_blocks: int | None = None,
) -> None:
    """Append keys for the full blocks of `token_ids` (at most `max_blocks` in all) not yet
    in `block_hashes`: the same keys as chaining `hash_block_tokens`.

    Incremental: only blocks that filled since the last call are hashed, so a request pays
    for each of its blocks once. The new tokens are packed in one call because admission
    hashes whole prompts.
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None and max_blocks < num_full:
        num_full = max_blocks
    num_hashed = len(block_hashes)
    if num_hashed >= num_full:
        return
    start, end = num_hashed * block_size, num_full * block_size
    packed = _int64_packer(end - start)(*token_ids[start:end])
    header = _BLOCK_LEN.pack(block_size)
    parent = block_hashes[-1] if num_hashed else ROOT_HASH
    width = 8 * block_size
    sha256 = hashlib.sha256
    offset = 0
    while offset < len(packed):
        parent = sha256(parent + header + packed[offset : offset + width] + extra_keys).digest()
        block_hashes.append(parent)
        offset += width


def hash_request_tokens(
    token_ids: Sequence[int], block_size: int, extra_keys: bytes = b""
) -> list[BlockHash]:
    """Keys of all full blocks of a token sequence (a convenience for tools and tests)."""
    block_hashes: list[BlockHash] = []
    extend_block_hashes(block_hashes, token_ids, block_size, extra_keys)
    return block_hashes
