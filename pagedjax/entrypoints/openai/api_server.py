"""The OpenAI-compatible HTTP server: `build_app` (the FastAPI app over an engine) and
`run_server` (what `pagedjax serve` runs).

Every error answers in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`:
a client's mistake is a 400 (401, 404) naming the field, a full queue or a dead engine a 503.
A client that goes away aborts its requests at once, streamed or not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import jax
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pagedjax import distributed
from pagedjax.config import EngineConfig
from pagedjax.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedjax.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    ServingError,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from pagedjax.entrypoints.openai.serving import engine_error
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedjax.entrypoints.openai.serving_models import ServingModels, parse_lora_modules
from pagedjax.errors import EngineDeadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Status of a response nobody reads: the client closed the connection (nginx's convention).
CLIENT_CLOSED = 499


def error_response(error: ServingError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(), status_code=error.status)


def _validation_error(request: Request, exc: RequestValidationError) -> ServingError:
    """A 400 naming the first offending field, in place of FastAPI's 422."""
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and "json" not in content_type:
        return ServingError(
            f"send the body as JSON with 'Content-Type: application/json', not {content_type!r}"
        )
    errors = exc.errors()
    if not errors:
        return ServingError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return ServingError(f"the request body is not valid JSON: {detail}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc:
        return ServingError(f"the request body must be a JSON object: {message}")
    where = ".".join(loc)
    if not message.startswith(where):  # a validator's own message names its field
        message = f"{where}: {message}"
    return ServingError(message, loc[0])


class SSEResponse(StreamingResponse):
    """A server-sent event stream that stops at once when the client disconnects (whatever
    the ASGI version), and always closes its iterator: that aborts the engine requests."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            await self.body_iterator.aclose()
        error = None if streaming.cancelled() else streaming.exception()
        # An OSError is a send to a client that left; anything else is worth a log line.
        if isinstance(error, Exception) and not isinstance(error, OSError):
            logger.error("stream failed", exc_info=error)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Awaitable[BaseModel | AsyncIterator[str]]) -> Response:
    """Runs a handler until it answers or the client disconnects; a disconnect cancels it,
    which aborts its engine requests. A stream is answered as server-sent events."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    result = task.result()  # a ServingError raises here, for its handler
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return SSEResponse(result, headers={"Cache-Control": "no-cache"})


def build_app(
    engine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    owns_engine: bool = False,
    models: ServingModels | None = None,
) -> FastAPI:
    """The app over an `AsyncLLM` (or anything with its interface). With `api_key`, the
    /v1 endpoints want `Authorization: Bearer <api_key>`. With `owns_engine`, the app shuts
    the engine down when it stops (uvicorn re-raises SIGTERM after that, killing the process
    before any code after `run` could). models: the base model and its LoRA adapters (by
    default the base model alone)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owns_engine:
                engine.shutdown()

    app = FastAPI(title="pagedjax", version=_version(), lifespan=lifespan)
    metrics = ServerMetrics(engine.stats, served_model_name)
    max_model_len: int = engine.config.max_model_len
    if models is None:
        root = str(engine.config.model or served_model_name)
        models = ServingModels(engine, served_model_name, root, max_model_len)
    completions = OpenAIServingCompletion(engine, models, metrics)
    chat = OpenAIServingChat(engine, models, metrics)
    app.state.engine, app.state.metrics = engine, metrics
    tokenizer = engine.tokenizer

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ServingError(
                "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                status=401,
                type="authentication_error",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, completions.create(body))

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, chat.create(body))

    _add_model_routes(v1, models)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            dead = EngineDeadError(f"the engine loop stopped: {engine.dead_error!r}")
            return error_response(engine_error(dead))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServingError("give either prompt or messages", "prompt")
        if body.messages is not None:
            tokens = chat.chat_prompt(body.messages)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        completions.check_model(body.model)
        vocab_size = completions.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ServingError(f"tokens {bad[:5]} are outside [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    _add_error_handlers(app)
    return app


def _add_model_routes(v1: APIRouter, models: ServingModels) -> None:
    """/v1/models, and vLLM's endpoints that load and unload LoRA adapters while serving."""

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load(body))

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload(body))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServingError)
    async def serving_error(_: Request, exc: ServingError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(ServingError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(engine_error(exc))


def _version() -> str:
    try:
        return metadata.version("pagedjax")
    except metadata.PackageNotFoundError:
        return "unknown"


def default_model_name(model: str | None) -> str:
    """The name clients call the model by: the path's last part, or the default model's."""
    return Path(model).name if model else DEFAULT_MODEL_NAME


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the command line set (the others keep their defaults)."""
    names = [f.name for f in fields(EngineConfig) if f.name != "model"]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


async def _load_lora_modules(models: ServingModels, specs: list[str]) -> None:
    """`--lora-modules name=path ...`, each read and registered before the port opens."""
    for name, path in parse_lora_modules(specs).items():
        try:
            await models.load(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
        except ServingError as error:
            raise SystemExit(f"pagedjax serve: --lora-modules {name}: {error.message}") from None


def run_server(args: argparse.Namespace) -> int:
    """Loads the engine, serves until interrupted, and shuts the engine down."""
    import uvicorn

    from pagedjax.async_llm import AsyncLLM
    from pagedjax.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_options(args.model, **engine_options(args))
        # The engine core in a process of its own unless asked not to, or over several hosts
        # (each host's process is a whole engine there).
        core_process = args.core_process and not distributed.joins_processes(
            config.coordinator_address
        )
        core = LLMEngine(config, core_process=core_process)
        if not core.is_leader:  # another host's process: make process 0's device calls
            logger.info("process %d follows process 0's engine", jax.process_index())
            core.follow(until_stop=True)
            return 0
        engine = AsyncLLM(engine=core, max_waiting_requests=args.max_waiting_requests)
    except ValueError as e:  # a bad option or model: its message says what to change
        raise SystemExit(f"pagedjax serve: {e}") from e
    try:
        if args.warmup:
            # Compiled before the port opens, so no client's first request pays for it; the
            # engine loop is idle until a request comes.
            seconds = core.engine_core.warmup()
            logger.info("compiled every step shape in %.1f s", seconds)
        name = args.served_model_name or default_model_name(args.model)
        models = ServingModels(engine, name, str(args.model or name), config.max_model_len)
        asyncio.run(_load_lora_modules(models, args.lora_modules or []))
        app = build_app(engine, name, api_key=args.api_key, owns_engine=True, models=models)
        logger.info("serving %s on http://%s:%d", name, args.host, args.port)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            # Open streams would otherwise hold a shutdown (Ctrl-C) forever.
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()  # when start-up failed (the port is taken) or without a signal
    return 0
