"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

/v1/chat/completions and /v1/completions (streamed as server-sent events, `data: [DONE]` last), /v1/models,
/tokenize, /detokenize, /health. Every error is OpenAI's error JSON with the right status and the field at fault;
a request the engine refuses fails before a byte is streamed. Admission: requests accepted but not yet started are
bounded (ServeConfig.max_waiting_*), past that a 429 with Retry-After instead of an unbounded queue.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers

from minillm.config import ServeConfig
from minillm.interfaces import AdmissionPolicy, missing_members
from minillm.engine.outputs import RequestOutput
from minillm.engine.prompt import build_prompt_ids
from minillm.serve import responses as R
from minillm.serve.async_engine import AsyncEngine, EngineDead, RequestStream
from minillm.serve.live import EngineView
from minillm.serve.metrics import CONTENT_TYPE, EngineMetrics
from minillm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                    TokenizeRequest, error_body, sampling_params)


STATIC = Path(__file__).parent / "static"     # the page: plain HTML, CSS and JS, no build step
LIVE_POLL_S = 0.1
DISCONNECT_POLL_S = 0.1                             # how often a non-streamed request looks for its client


@dataclass
class ServedModel:
    """What the routes need to know of the model behind the engine."""
    name: str
    tokenizer: Any
    max_model_len: int
    sampling_defaults: dict


class TokenBudgetAdmission:
    """minillm's admission rule: at most `max_waiting_requests` requests and `max_waiting_tokens` prompt tokens
    waiting to start. A request larger than the token budget is still admitted when nothing waits (else it could
    never run: the KV pool and max_model_len decide whether it fits)."""

    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int) -> None:
        self.max_waiting_requests, self.max_waiting_tokens = max_waiting_requests, max_waiting_tokens

    def admit(self, waiting_requests: int, waiting_tokens: int, prompt_tokens: int) -> bool:
        if waiting_requests + 1 > self.max_waiting_requests:
            return False
        return waiting_requests == 0 or waiting_tokens + prompt_tokens <= self.max_waiting_tokens


class Admission:
    """The requests (and their prompt tokens) accepted but not started yet, and the policy that bounds them: a
    burst past it gets a 429 at once instead of waiting in an unbounded queue. On the event loop's thread only."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        missing = missing_members(policy, AdmissionPolicy)
        if missing:
            raise TypeError(f"admission: a {type(policy).__name__} lacks {', '.join(missing)} of "
                            "minillm.interfaces.AdmissionPolicy")
        self.policy, self.requests, self.tokens = policy, 0, 0

    def enter(self, tokens: int) -> None:
        if not self.policy.admit(self.requests, self.tokens, tokens):
            raise RequestError(f"the server is busy: {self.requests} requests ({self.tokens} prompt tokens) are "
                               "waiting to start; retry shortly", None, 429, "rate_limit_exceeded",
                               {"Retry-After": "1"})
        self.requests, self.tokens = self.requests + 1, self.tokens + tokens

    def leave(self, tokens: int) -> None:
        self.requests, self.tokens = self.requests - 1, self.tokens - tokens


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


class Serving:
    """The engine and model behind the routes; None while the model loads (every model route answers 503)."""

    def __init__(self, engine: AsyncEngine | None = None, model: ServedModel | None = None,
                 metrics: EngineMetrics | None = None, view: EngineView | None = None) -> None:
        self.engine, self.model, self.metrics, self.view = engine, model, metrics, view

    def ready(self) -> tuple[AsyncEngine, ServedModel]:
        if self.engine is None or self.model is None:
            raise RequestError("the model is still loading: retry in a few seconds", None, 503, "server_error",
                               {"Retry-After": "5"})
        return self.engine, self.model


def build_app(serving: Serving, config: ServeConfig | None = None, admission: AdmissionPolicy | None = None
              ) -> FastAPI:
    """The app over `serving` (its engine may arrive later: set serving.engine / serving.model once loaded).
    `admission` decides which requests may wait to start (default: TokenBudgetAdmission with config's limits)."""
    config = config or ServeConfig()
    policy = admission if admission is not None else \
        TokenBudgetAdmission(config.max_waiting_requests, config.max_waiting_tokens)
    app = FastAPI(title="minillm", docs_url=None, redoc_url=None)
    app.state.serving, app.state.admission = serving, Admission(policy)
    app.add_middleware(_Guard, config=config)
    _install_errors(app)
    api = _Routes(serving, app.state.admission)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    app.get("/v1/models")(api.models)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/engine/state")(api.engine_state)
    app.get("/engine/events")(api.engine_events)
    app.get("/", response_class=HTMLResponse)(api.page)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class _Guard:
    """What every request passes before its route: the API key, the body's size, JSON whatever the label. Plain
    ASGI rather than @app.middleware("http"), whose wrapper hides a client's hang-up from the route and passes each
    streamed chunk through another task."""

    def __init__(self, app: Any, config: ServeConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope, Headers(scope=scope))
            if refusal is not None:
                return await refusal(scope, receive, send)
            if scope["method"] == "POST":
                # every body here is JSON: `curl -d '{...}'` (sent as a form by default) works as it does with OpenAI
                scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"] +
                             [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict, headers: Headers) -> JSONResponse | None:
        key = self.config.api_key
        if key is not None and scope["path"].startswith("/v1") and headers.get("authorization") != f"Bearer {key}":
            return _error(401, "a valid API key is needed: send the header `Authorization: Bearer <key>` (the "
                               "server's --api-key)", "authentication_error")
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.config.max_body_bytes:
            return _error(413, f"the request body is {int(size)} bytes, more than this server takes "
                               f"({self.config.max_body_bytes}; --max-body-bytes)")
        return None


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON (UTF-8 text with one JSON object)")
        where = ".".join(loc) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}", param=loc[0] if loc else None)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(EngineDead)
    async def dead(request: Request, exc: EngineDead) -> JSONResponse:
        return _error(503, str(exc), "server_error")


class _Routes:
    def __init__(self, serving: Serving, admission: Admission) -> None:
        self.serving, self.admission = serving, admission

    @property
    def engine(self) -> AsyncEngine:
        return self.serving.ready()[0]

    @property
    def model(self) -> ServedModel:
        return self.serving.ready()[1]

    # ------------------------------------------------------------------ requests
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model.name, "default"):
            raise RequestError(f"the model {name!r} does not exist here: this server serves {self.model.name!r}",
                               "model", 404, "model_not_found")

    async def _start(self, prompt_ids: list[int], req: Any) -> tuple[RequestStream, Any]:
        params = sampling_params(req, len(prompt_ids), self.model.max_model_len, self.model.sampling_defaults)
        self.admission.enter(len(prompt_ids))
        try:
            stream = await self.engine.submit(prompt_ids, params)
        except (ValueError, TypeError) as e:
            self.admission.leave(len(prompt_ids))
            what = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            param = "response_format" if "Schema" in str(e) or "regex" in str(e) else what
            raise RequestError(str(e), param) from None
        except BaseException:
            self.admission.leave(len(prompt_ids))
            raise
        stream.latest_only = True                       # responses send what is new since their last message
        return _Started(stream, len(prompt_ids), self.admission), params

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(req.model)
        try:
            ids = build_prompt_ids(self.model.tokenizer, req.messages)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        stream, _ = await self._start(ids, req)
        top = req.top_logprobs or 0
        if not req.stream:
            outs = await _while_connected(request, [stream])
            return outs if isinstance(outs, Response) else R.chat_response(outs[0], self.model.name, top)
        include = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(self._chat_events(stream, req.n, top, include))

    async def _chat_events(self, stream: "_Started", n: int, top: int, include: bool) -> AsyncIterator[dict]:
        rid, created, name, deltas = R.new_id("chatcmpl"), int(time.time()), self.model.name, R.Deltas()
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(n)]
        yield R.chunk("chat.completion.chunk", rid, created, name, opening, None, include)
        last = None
        try:
            async for out in stream:
                last = out
                choices = R.chat_delta_choices(out, deltas, top)
                if choices:
                    yield R.chunk("chat.completion.chunk", rid, created, name, choices, None, include)
        finally:                                        # a client that went away: abort, free its blocks
            await stream.aclose()
        if include and last is not None:
            yield R.chunk("chat.completion.chunk", rid, created, name, [], R.usage([last]), True)

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        self._check_model(req.model)
        prompts = _prompts(req.prompt, self.model.tokenizer)
        started = []
        try:
            for ids in prompts:
                started.append((await self._start(ids, req))[0])
        except BaseException:
            for s in started:
                await s.aclose()
            raise
        if not req.stream:
            outs = await _while_connected(request, started)
            return outs if isinstance(outs, Response) else \
                R.completion_response(outs, self.model.name, req.logprobs, req.n)
        include = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(self._completion_events(started, req.n, req.logprobs, include))

    async def _completion_events(self, streams: list["_Started"], n: int, logprobs: int | None,
                                 include: bool) -> AsyncIterator[dict]:
        rid, created, name = R.new_id("cmpl"), int(time.time()), self.model.name
        finals = []
        try:
            for base, stream in enumerate(streams):      # read one after another; they run concurrently
                deltas, last = R.Deltas(), None
                async for out in stream:
                    last = out
                    choices = R.completion_delta_choices(out, deltas, base, n, logprobs)
                    if choices:
                        yield R.chunk("text_completion", rid, created, name, choices, None, include)
                if last is not None:
                    finals.append(last)
        finally:
            for stream in streams:
                await stream.aclose()
        if include:
            yield R.chunk("text_completion", rid, created, name, [], R.usage(finals), True)

    # ------------------------------------------------------------------ the rest
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model.name, "object": "model", "created": 0,
                                            "owned_by": "minillm", "max_model_len": self.model.max_model_len}]}

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt (text) or messages (a chat)", "prompt")
        try:
            ids = build_prompt_ids(self.model.tokenizer, req.messages) if req.messages is not None else \
                self.model.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.model.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        vocab = self.model.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.model.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def page(self) -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    async def engine_state(self) -> dict:
        view = self.serving.view
        if view is None or self.serving.engine is None:
            raise RequestError("the model is still loading", None, 503, "server_error", {"Retry-After": "5"})
        return await self.serving.engine.call(view.refresh)

    async def engine_events(self, request: Request) -> StreamingResponse:
        """The live view as server-sent events: a snapshot whenever the engine stepped since the last one."""
        return StreamingResponse(_live_events(request, self.serving), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def metrics(self) -> Response:
        m = self.serving.metrics
        return Response(m.exposition() if m is not None else b"", media_type=CONTENT_TYPE)

    async def health(self) -> Any:
        if self.serving.engine is None:
            return _error(503, "the model is still loading", "server_error")
        if not self.serving.engine.is_running:
            return _error(503, "the engine is not running", "server_error")
        return {"status": "ok"}


class _Started:
    """A started request's stream that releases its admission slot at the first output (it is no longer waiting)
    or when it ends."""

    def __init__(self, stream: RequestStream, tokens: int, admission: Admission) -> None:
        self.stream, self.tokens, self.admission, self.waiting = stream, tokens, admission, True

    def _started(self) -> None:
        if self.waiting:
            self.waiting = False
            self.admission.leave(self.tokens)

    def __aiter__(self) -> "_Started":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self.stream.__anext__()
        except BaseException:
            self._started()
            raise
        self._started()
        return out

    async def aclose(self) -> None:
        self._started()
        await self.stream.aclose()


async def _last(stream: _Started) -> RequestOutput:
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        await stream.aclose()
    return last


async def _while_connected(request: Request, streams: list[_Started]) -> list[RequestOutput] | Response:
    """The final outputs of non-streamed requests, read while their client is there: one that hangs up aborts
    them (their blocks are free within a step) and gets 499, nginx's "client closed request", sent to no one."""
    task = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return Response(status_code=499)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for stream in streams:                          # also those cancelled before they began
            await stream.aclose()


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """completions' `prompt`: a text, a list of texts, a list of token ids, or a list of those."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("prompt is empty: give a text or a list of token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except EngineDead as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error', None, 503))}\n\n"
        finally:                                        # a disconnect cancels us here: end the request with us
            await events.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _live_events(request: Request, serving: Serving) -> AsyncIterator[str]:
    """A snapshot whenever the engine stepped since the last one (the first at once, fresh); a comment line now
    and then while idle. The view works only while someone watches."""
    seen, quiet, view = -1, 0.0, None
    try:
        while not await request.is_disconnected():
            if view is None and serving.view is not None and serving.engine is not None:
                view = serving.view
                view.watchers += 1
                await serving.engine.call(view.refresh)
            version, snap = view.latest() if view is not None else (-1, None)
            if snap is not None and version != seen:
                seen, quiet = version, 0.0
                yield f"data: {json.dumps(snap)}\n\n"
            elif quiet > 15:                           # keeps proxies from closing an idle stream
                quiet = 0.0
                yield ": idle\n\n"
            await asyncio.sleep(LIVE_POLL_S)
            quiet += LIVE_POLL_S
    finally:
        if view is not None:
            view.watchers -= 1
