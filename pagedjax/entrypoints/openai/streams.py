"""Helpers over several `AsyncLLM.generate` streams (one per prompt of a request): start them
together, merge their outputs, and close them all whatever happens, so that no request the
client no longer waits for keeps its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pagedjax.outputs import RequestOutput

Stream = AsyncGenerator[RequestOutput, None]
T = TypeVar("T")


class EmptyStreamError(RuntimeError):
    """A stream ended without any output (the engine dropped the request)."""


async def close_all(streams: list[Stream]) -> None:
    """Closes every stream; closing one that is still running aborts its request."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def _gather_or_close(
    streams: list[Stream], step: Callable[[Stream], Awaitable[T]]
) -> list[T]:
    """`step` on every stream at once; if one fails or the caller is cancelled, the others are
    cancelled and every stream closed before the error propagates."""
    tasks = [asyncio.ensure_future(step(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)
        raise


async def _first(stream: Stream) -> RequestOutput:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise EmptyStreamError("the engine ended the request without output") from None


async def first_outputs(streams: list[Stream]) -> list[RequestOutput]:
    """Each stream's first output. The engine refuses a request (bad input, full queue, dead
    engine) at its first output, so this runs before a response starts: a refusal becomes an
    HTTP error, not a broken stream."""
    return await _gather_or_close(streams, _first)


async def final_outputs(streams: list[Stream], firsts: list[RequestOutput]) -> list[RequestOutput]:
    """Each stream's last output, given its first (FINAL_ONLY requests have only one); the
    streams are closed after."""
    first_of = {id(stream): first for stream, first in zip(streams, firsts, strict=True)}

    async def last(stream: Stream) -> RequestOutput:
        output = first_of[id(stream)]
        while not output.finished:
            output = await _first(stream)
        return output

    try:
        return await _gather_or_close(streams, last)
    finally:
        await close_all(streams)


async def merge(
    streams: list[Stream], firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as outputs come, starting with the given first outputs. Closing
    the iterator (or cancelling its consumer) closes all the streams."""
    try:
        for index, output in enumerate(firsts):
            yield index, output
        if len(streams) == 1:  # the common case needs no tasks
            async for output in streams[0]:
                yield 0, output
            return
        pending = {asyncio.ensure_future(_first(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    try:
                        output = task.result()
                    except EmptyStreamError:
                        continue  # this stream is over
                    pending[asyncio.ensure_future(_first(streams[index]))] = index
                    yield index, output
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await close_all(streams)
