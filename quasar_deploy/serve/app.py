"""The HTTP side: OpenAI's routes over the scheduler, API-key and body-size guards, errors always in OpenAI's shape.

Handlers only parse, submit and relay; a ``ClientWatch`` ends whatever a request waits for when its client goes."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..chat.renderer import RendererError
from ..engine import Engine
from ..errors import QuasarError
from ..files import first_line
from ..speculative.output_cache import OutputCache
from .disconnect import ClientGone, ClientWatch
from .metrics import Metrics
from .protocol import ApiError, RequestLimits, parse_json, parse_request
from .responses import Shaper, sse
from .scheduler import PREFILL_TOKENS, Done, Event, Failed, QueueFull, Scheduler, Text, Ticket

RETRY_AFTER_S = "1"  # what 429 and 503 tell a client to wait: admission frees up as sequences finish, a drain ends soon
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before its response was complete


@dataclass(frozen=True)
class ServeConfig:
    """What ``quasar-deploy serve`` decides besides the engine: the served name, limits, security, default drafting.

    ``request_timeout``: seconds from arrival (queueing included) to 504; ``body_timeout``: to 408; ``kv_cache_bytes``
    None: no accounting."""

    model: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_sequences: int = 8
    max_queue: int = 32
    draft: str = "ngram"
    num_draft: int | None = None
    adaptive_k: bool = False
    request_timeout: float = 600.0
    body_timeout: float = 30.0
    kv_cache_bytes: int | None = None
    prefill_tokens: int = PREFILL_TOKENS
    row_budget: bool = True
    suffix_cache_tokens: int = 0
    limits: RequestLimits = RequestLimits()

    def __post_init__(self) -> None:
        if self.num_draft is not None and not 1 <= self.num_draft <= self.limits.max_num_draft:
            raise QuasarError(f"--num-draft {self.num_draft} is above --max-num-draft {self.limits.max_num_draft}")


def error_response(error: ApiError) -> JSONResponse:
    """The error in OpenAI's shape; 429 and 503 (capacity, draining) say when to retry, so clients back off, not hammer."""
    retry = {"Retry-After": RETRY_AFTER_S} if error.status in (429, 503) else {}
    return JSONResponse(error.body(), status_code=error.status, headers={**retry, **error.headers})


class Guard:
    """ASGI middleware (plain, so streams pass through): the API key on every route but /health, the request counter
    (a client gone before its response was complete counts as ``CLIENT_CLOSED``)."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    def _authorized(self, scope: dict) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, complete, gone = 500, False, False

        async def receive_watching() -> dict:
            nonlocal gone
            message = await receive()
            gone = gone or (message["type"] == "http.disconnect" and not complete)
            return message

        async def send_counting(message: dict) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True  # before sending: once it is sent, receive() says "http.disconnect" for any request
            await send(message)

        try:
            refused = self.api_key and scope["path"] != "/health" and not self._authorized(scope)
            app = error_response(ApiError(401, "a valid API key is required (Authorization: Bearer KEY)")) if refused else self.app
            await app(scope, receive_watching, send_counting)
        finally:
            endpoint = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(CLIENT_CLOSED if gone else status)).inc()


async def read_json(request: HttpRequest, limit: int, timeout_s: float) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (declared or streamed), 408 if not all in within ``timeout_s``."""
    too_large = ApiError(413, f"the request body is larger than the limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    try:
        body = await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return parse_json(body)


def create_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The server's app; the scheduler's worker runs for the app's lifespan. ``app.state.draining`` refuses new work (503)."""
    metrics = Metrics()
    # set either way: an engine served before with a cache must not keep it under a config without one
    engine.output_cache = OutputCache(config.suffix_cache_tokens) if config.suffix_cache_tokens else None
    scheduler = Scheduler(
        engine,
        metrics,
        config.max_sequences,
        config.max_queue,
        prefill_tokens=config.prefill_tokens,
        deadline_s=config.request_timeout,
        kv_cache_bytes=config.kv_cache_bytes,
        row_budget=config.row_budget,
    )
    started_at = int(time.time())
    defaults = {"draft": config.draft, "num_draft": config.num_draft, "adaptive_k": config.adaptive_k, "verify": engine.verify_modes}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop, app.state.ended = asyncio.get_running_loop(), asyncio.Event()
        if getattr(engine.tokenizer, "chat_template", None):
            engine.renderer.start()  # its process starts beside the server, not at the first chat
        scheduler.start()
        yield
        scheduler.stop()

    def in_flight() -> int:
        """Requests the server still owes an answer: in the scheduler, or rendering their chat template."""
        return scheduler.busy + engine.renderer.busy

    def end_in_flight() -> None:
        """A drain's deadline (from another thread): every request in flight ends now with 503."""
        scheduler.end_all(ApiError(503, "the server is shutting down"))
        app.state.loop.call_soon_threadsafe(app.state.ended.set)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.draining = scheduler, metrics, False
    app.state.in_flight, app.state.end_in_flight = in_flight, end_in_flight
    app.add_middleware(Guard, api_key=config.api_key, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientDisconnect)  # gone while its body arrived
    @app.exception_handler(ClientGone)  # gone while it waited
    async def client_gone(request: HttpRequest, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: the status is for the metrics

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {first_line(exc)}"))

    async def complete(request: HttpRequest, chat: bool) -> Response:
        if app.state.draining:
            raise ApiError(503, "the server is shutting down")
        parsed = parse_request(
            await read_json(request, config.max_body_bytes, config.body_timeout), chat, config.model, defaults, config.limits
        )
        watch = ClientWatch(request.receive, app.state.ended)
        ticket, streaming = None, False
        try:
            if chat:
                parsed = dataclasses.replace(parsed, prompt=await watch.until_gone(render(parsed.prompt)))
            elif isinstance(parsed.prompt, str):
                parsed = dataclasses.replace(parsed, prompt=await watch.until_gone(tokenize(parsed.prompt)))
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def deliver(event: Event) -> None:
                with suppress(RuntimeError):  # the event loop has closed (server stopped): nobody is waiting for this event
                    loop.call_soon_threadsafe(events.put_nowait, event)

            ticket = Ticket(parsed, deliver)
            try:
                scheduler.submit(ticket)
            except QueueFull:
                raise ApiError(429, "the server is at capacity; retry later") from None
            event = await next_event(watch, events)  # Started, or the prompt's failure
            shaper = Shaper(config.model, chat)
            if parsed.stream:
                streaming = True
                return StreamingResponse(stream(ticket, events, shaper, parsed.include_usage, watch), media_type="text/event-stream")
            while not isinstance(event, Done):
                event = await next_event(watch, events)
            return JSONResponse(shaper.full(event.result))
        except BaseException:
            if ticket is not None:
                scheduler.cancel(ticket)
            raise
        finally:
            if not streaming:
                watch.close()

    async def tokenize(text: str) -> list[int]:
        """A completion's prompt ids, encoded on a worker thread (off the scheduler's); 400 if the engine refuses it."""
        try:
            return await asyncio.to_thread(engine.encode, text)
        except QuasarError as exc:
            raise ApiError(400, str(exc), "prompt") from None

    async def render(messages: list[dict[str, str]]) -> list[int]:
        """The chat's prompt ids: 400 when the template refuses or passes a bound, 500 when the renderer fails."""
        try:
            return await engine.renderer.render_async(engine.chat_messages(messages))
        except RendererError as exc:
            raise ApiError(500, f"internal error: {exc}") from None
        except QuasarError as exc:
            raise ApiError(400, str(exc), "messages") from None

    async def next_event(watch: ClientWatch, events: asyncio.Queue) -> Event:
        """The ticket's next event; a failure raises, and so does the client going (``ClientGone``)."""
        event = await watch.until_gone(events.get())
        if isinstance(event, Failed):
            raise event.error
        return event

    async def stream(ticket: Ticket, events: asyncio.Queue, shaper: Shaper, include_usage: bool, watch: ClientWatch) -> AsyncIterator[str]:
        """SSE chunks until ``[DONE]``, a failure the last before it; the client going ends it at once."""
        try:
            if shaper.chat:
                yield sse(shaper.chunk("", include_usage=include_usage))
            while True:
                try:
                    event = await next_event(watch, events)
                except ClientGone:
                    return
                except ApiError as error:
                    yield sse(error.body())
                    break
                if isinstance(event, Text):
                    yield sse(shaper.chunk(event.text, include_usage=include_usage))
                elif isinstance(event, Done):
                    yield sse(shaper.chunk(result=event.result, include_usage=include_usage))
                    if include_usage:
                        yield sse(shaper.usage_chunk(event.result))
                    break
            yield sse("[DONE]")
        finally:
            scheduler.cancel(ticket)
            watch.close()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        return await complete(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": config.model, "object": "model", "created": started_at, "owned_by": "quasar-deploy"}
        return {"object": "list", "data": [{**model, "max_model_len": engine.lm.max_length}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 while draining, so a load balancer stops sending work here before the process exits."""
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
