"""The OpenAI HTTP API in front of a `Backend`: `make_app(backend, tokenizer)` is a FastAPI app.

    GET  /v1/models            the one model served
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template
    POST /v1/completions       a prompt as text or token ids
    GET  /health, /metrics     liveness; Prometheus counters, histograms and the engine's gauges

The event loop never waits on the engine: a request is rendered and tokenized here, submitted
(`Backend.submit` only queues it) and its `Delta`s are read as they come. Bodies are read and
validated here (not by FastAPI's body parameters) so that every bad input is a 4xx OpenAI
error object; anything unexpected is logged and answered 500 in the same shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from jaxrl_scale.models import parsers
from jaxrl_scale.serve import protocol
from jaxrl_scale.serve.backend import Backend, Generation, QueueFull, Request, ShuttingDown
from jaxrl_scale.serve.sessions import Session, SessionError, Sessions, digest
from jaxrl_scale.serve.text import ChoiceText
from jaxrl_scale.tasks.env import Observations

log = logging.getLogger("jaxrl_scale.serve")
MAX_BODY_BYTES = 8 << 20  # a request body over this is refused (413)
RETRY_AFTER_S = 1  # what a 429 asks the client to wait
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics")
SESSION_ENDPOINTS = ("/v1/models", "/v1/chat/completions")  # under /sessions/<id>


class APIError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        body = protocol.error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------- telemetry


class _EngineGauges:
    """The backend's queue and slots, read at each scrape."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def collect(self):
        stats = self.backend.stats()
        slots, busy = stats.get("slots", 0), stats.get("slots_busy", 0)
        yield GaugeMetricFamily(
            "jaxrl_serve_queue_length",
            "requests waiting for a slot",
            value=stats.get("queue_length", 0),
        )
        yield GaugeMetricFamily("jaxrl_serve_slots", "decode slots", value=slots)
        yield GaugeMetricFamily("jaxrl_serve_slots_busy", "decode slots in use", value=busy)
        yield GaugeMetricFamily(
            "jaxrl_serve_slot_occupancy",
            "share of the slots in use",
            value=busy / slots if slots else 0.0,
        )


@dataclasses.dataclass
class _Metrics:
    registry: CollectorRegistry
    requests: Counter
    prompt_tokens: Counter
    generated_tokens: Counter
    time_to_first_token: Histogram
    tokens_per_second: Histogram
    seconds: Histogram

    @classmethod
    def create(cls, backend: Backend) -> _Metrics:
        r = CollectorRegistry()  # per app: several servers may live in one process (tests)
        r.register(_EngineGauges(backend))
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        return cls(
            registry=r,
            requests=Counter(
                "jaxrl_serve_requests",
                "HTTP requests by endpoint and status",
                ["endpoint", "status"],
                registry=r,
            ),
            prompt_tokens=Counter("jaxrl_serve_prompt_tokens", "prompt tokens", registry=r),
            generated_tokens=Counter(
                "jaxrl_serve_generated_tokens", "generated tokens", registry=r
            ),
            time_to_first_token=Histogram(
                "jaxrl_serve_time_to_first_token_seconds",
                "request to its first token",
                buckets=latency,
                registry=r,
            ),
            tokens_per_second=Histogram(
                "jaxrl_serve_tokens_per_second",
                "a request's generated tokens per second after its first",
                buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
                registry=r,
            ),
            seconds=Histogram(
                "jaxrl_serve_request_seconds",
                "request to its last token",
                buckets=latency,
                registry=r,
            ),
        )


@dataclasses.dataclass
class _Record:
    """What a completion request logs and counts when it ends."""

    rid: str
    started: float
    prompt: int = 0
    completion: int = 0
    first_token: float | None = None
    note: str = ""
    digest: str = ""

    def tokens(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.perf_counter()
        self.completion += n


def _telemetry(app, metrics: _Metrics):
    """ASGI middleware: each HTTP request counted by endpoint and status, and logged once."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        started, status = time.perf_counter(), 500
        state = scope.setdefault("state", {})

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_status)
        finally:
            path = scope["path"]
            endpoint = _endpoint(path)
            metrics.requests.labels(endpoint, str(status)).inc()
            record: _Record | None = state.get("record")
            seconds = time.perf_counter() - started
            if record is None:
                if endpoint not in ("/health", "/metrics"):
                    log.info("%s %s %d %.3fs", scope["method"], path, status, seconds)
            else:
                ttft = (
                    "-"
                    if record.first_token is None
                    else (f"{record.first_token - record.started:.3f}s")
                )
                log.info(
                    "%s %s %d prompt=%d completion=%d ttft=%s %.3fs%s",
                    record.rid,
                    path,
                    status,
                    record.prompt,
                    record.completion,
                    ttft,
                    seconds,
                    f" ({record.note})" if record.note else "",
                )

    return middleware


def _endpoint(path: str) -> str:
    """The metrics label of `path`: a session's endpoints by their route, not their id."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/sessions/"):
        rest = "/" + path[len("/sessions/") :].partition("/")[2]
        if rest in SESSION_ENDPOINTS:
            return "/sessions/{id}" + rest
    return "other"


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class _Served:
    """What every handler reads."""

    backend: Backend
    tokenizer: Any
    model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: _Metrics
    family: str  # tool call format (models/parsers.py)
    sessions: Sessions | None = None  # agents' sessions (serve/sessions.py)
    token_texts: dict[int, str] = dataclasses.field(default_factory=dict)

    def token_text(self, token: int) -> str:
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False
            )
        return text

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes: for a byte-level BPE piece (Qwen, Llama-3) the bytes its
        characters stand for, which may be part of one UTF-8 character (its text alone
        would be U+FFFD); else its text's UTF-8."""
        return list(self.tokenizer.token_bytes(token, skip_special_tokens=False))


def make_app(
    backend: Backend,
    tokenizer,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    model_name: str | None = None,
    sessions: Sessions | None = None,
) -> FastAPI:
    """The OpenAI API serving `backend` (which the caller closes). `tokenizer` renders chat
    messages (its chat template) and turns text into ids and back. `api_key`: requests to /v1
    need `Authorization: Bearer <api_key>`. `model_name`: the id clients name (default the
    backend's). `sessions`: also serve each open session's calls under
    `/sessions/<id>/v1` (its secret as the key; serve/sessions.py)."""
    metrics = _Metrics.create(backend)
    served = _Served(
        backend,
        tokenizer,
        model_name or backend.model_name,
        api_key,
        max_body_bytes,
        metrics,
        parsers.tool_family(tokenizer),
        sessions,
    )
    app = FastAPI(title="jaxrl-scale", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_telemetry, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return APIError(e.status_code, message, kind, headers=e.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(request: HTTPRequest, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    async def authorize(request: HTTPRequest) -> None:  # async: no worker thread
        if served.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), served.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models():
        return protocol.models_list(served.model_name, served.backend.context)

    @v1.post("/chat/completions")
    async def chat(request: HTTPRequest):
        return await _chat(served, request)

    @v1.post("/completions")
    async def completions(request: HTTPRequest):
        return await _complete(served, request)

    app.include_router(v1)

    if sessions is not None:

        def session(sid: str, request: HTTPRequest) -> Session:
            try:
                return sessions.authorize(sid, request.headers.get("authorization", ""))
            except SessionError as e:
                kind = "authentication_error" if e.status == 401 else "not_found_error"
                raise APIError(e.status, str(e), kind, code=e.code) from None

        @app.get("/sessions/{sid}/v1/models")
        async def session_models(sid: str, request: HTTPRequest):
            session(sid, request)
            return protocol.models_list(served.model_name, served.backend.context)

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def session_chat(sid: str, request: HTTPRequest):
            return await _chat(served, request, session(sid, request))

    @app.get("/health")
    async def health():
        return {"status": "ok", **served.backend.stats()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --------------------------------------------------------------------------- requests


async def _parse(
    served: _Served, request: HTTPRequest, model: type[BaseModel], record: _Record | None = None
) -> Any:
    """The body as `model`: 413 past the size limit, 400 for bad JSON or a bad field (named).
    `record` keeps the body's digest (a session's retried call is known by it)."""
    limit = served.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(
            413, f"the body is {length} bytes, over the limit of {limit}", code="body_too_large"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413, f"the body is over the limit of {limit} bytes", code="body_too_large"
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    if record is not None:
        record.digest = digest(body)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"the body is not JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        param = _json_path(data, error)
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, protocol.FieldError):
            param = f"{param}.{cause.param}" if param else cause.param
        message = error["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _json_path(data: Any, error: dict) -> str | None:
    """A validation error's place in the request's JSON (pydantic's `loc` also names the
    members of union types, which the client never wrote)."""
    path, here = [], data
    loc = list(error["loc"])
    for i, key in enumerate(loc):
        inside = isinstance(here, list) and isinstance(key, int) and key < len(here)
        if inside or (isinstance(here, dict) and key in here):
            here = here[key]
        elif not (error["type"] == "missing" and i == len(loc) - 1):
            break
        path.append(str(key))
    return ".".join(path) or None


def _check_model(served: _Served, name: str) -> None:
    if name != served.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _budget(served: _Served, prompt: list[int], max_new: int | None, param: str) -> int:
    """The tokens a choice may generate: `max_new`, or all the context leaves."""
    context = served.backend.context
    if len(prompt) >= context:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; the context holds {context}",
            param=param,
            code="context_length_exceeded",
        )
    if max_new is None:
        return context - len(prompt)
    if len(prompt) + max_new > context:
        raise APIError(
            400,
            f"the prompt's {len(prompt)} tokens and max_tokens {max_new} make "
            f"{len(prompt) + max_new}, over the context of {context} tokens "
            f"(max_tokens <= {context - len(prompt)} fits)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_new


def _submit(served: _Served, request: Request) -> Generation:
    try:
        return served.backend.submit(request, asyncio.get_running_loop())
    except QueueFull as e:
        raise APIError(
            429,
            f"the server is busy ({e}); retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except RuntimeError as e:  # shutting down
        raise APIError(503, str(e), "server_error") from None


def _start(served: _Served, http: HTTPRequest, prefix: str) -> _Record:
    record = _Record(f"{prefix}-{uuid.uuid4().hex}", time.perf_counter())
    http.scope.setdefault("state", {})["record"] = record
    return record


async def _chat(served: _Served, http: HTTPRequest, session: Session | None = None) -> Response:
    record = _start(served, http, "chatcmpl")
    req: protocol.ChatRequest = await _parse(served, http, protocol.ChatRequest, record)
    _check_model(served, req.model)
    sessions = served.sessions
    if session is not None:
        if req.n != 1:
            raise APIError(400, "n: a session's call has one choice", param="n")
        retry = http.headers.get("x-stainless-retry-count", "0")  # the OpenAI SDK's
        answer = sessions.answered(session, record.digest)
        if retry not in ("", "0") and answer is not None and not req.stream:
            record.note = f"session {session.id}: a retry, answered again"
            return JSONResponse(answer, headers={"X-Request-Id": answer["id"]})
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.use_tools else None
    extra = dict(req.chat_template_kwargs or {})
    if tools:  # a template that reads it may say so to the model
        extra.setdefault("tool_choice", _dumped(req.tool_choice) or "auto")
    where, head, rendering = None, [], None
    try:
        messages = [m.for_template() for m in req.messages]
        if session is not None:
            # What the template renders with beside the messages: a change of it branches.
            rendering = {"tools": tools, "template": extra}
            where = sessions.place(session, messages, rendering)
        if where is not None and where.branch is not None:  # only the new messages
            text = Observations(served.tokenizer).after_turn(
                where.new, tools, ended_with=where.branch.ended_with, **extra
            )
            head = list(where.branch.ids)
        else:
            text = served.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, **extra
            )
        opened = parsers.prompt_opens_think(text)
        # A call that must be made: the answer starts with its opening (the call's format up
        # to the name, or a named function's arguments); the model writes the rest. No
        # grammar holds it to JSON: arguments it breaks come back as content.
        lead = ""
        if req.forced_tool is not None:
            lead = (parsers.THINK_CLOSE + "\n\n" if opened else "") + parsers.call_opening(
                served.family, req.forced_tool or None
            )
        prompt = head + served.tokenizer.encode(text + lead)
    except RecursionError:  # a body nested deeper than the template walks
        raise APIError(400, "messages: nested too deeply", param="messages") from None
    except (ValueError, TypeError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    turn = _Turn(served.family, req.use_tools, opened, req.parallel_tool_calls is not False, lead)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    fmt = _ChatFormat(served, req, turn)
    if session is None:
        return await _generate(served, http, record, req, prompt, top, fmt)
    eos = set(served.tokenizer.eos_ids)

    def keep(choices: list[ChoiceText], message: dict, answer: dict | None) -> bool:
        """The call answered: its ids into the session's branch (False: the session ended)."""
        c = choices[0]
        ended_with = c.ids[-1] if c.ids and c.ids[-1] in eos else None
        versions = c.versions if len(c.versions) == len(c.ids) else [-1] * len(c.ids)
        branch = sessions.record(session, where, prompt=prompt, reply=list(c.ids),
                                 logp=list(c.logprobs), versions=list(versions),
                                 messages=messages, message=message,
                                 tools=rendering, ended_with=ended_with, digest=record.digest,
                                 answer=answer)  # fmt: skip
        record.note = f"session {session.id}"
        if branch is not None:
            record.note += f" branch {branch.index}"
        return branch is not None

    return await _generate(served, http, record, req, prompt, top, fmt, (session, keep))


async def _complete(served: _Served, http: HTTPRequest) -> Response:
    record = _start(served, http, "cmpl")
    req: protocol.CompletionRequest = await _parse(served, http, protocol.CompletionRequest)
    _check_model(served, req.model)
    if isinstance(req.prompt, str):
        try:
            prompt = served.tokenizer.encode(req.prompt)
        except (ValueError, TypeError) as e:  # a lone surrogate; a character not in an alphabet
            raise APIError(400, f"prompt: {e}", param="prompt") from None
    else:
        prompt, vocab = list(req.prompt), served.tokenizer.vocab_size
        bad = [i for i in prompt if i >= vocab]
        if bad:
            raise APIError(
                400,
                f"prompt: token id {bad[0]} is outside the vocabulary (size {vocab})",
                param="prompt",
            )
    if not prompt:
        raise APIError(400, "prompt: no tokens", param="prompt")
    top = req.logprobs or 0
    return await _generate(served, http, record, req, prompt, top, _TextFormat(served, req, prompt))


async def _generate(
    served: _Served,
    http: HTTPRequest,
    record: _Record,
    req,
    prompt: list[int],
    top_logprobs: int,
    fmt: _Format,
    session: tuple[Session, Callable[[list[ChoiceText], dict, dict | None], bool]] | None = None,
) -> Response:
    """Submit, then answer with the whole response or an event stream. `session`: the
    session the call is in, and what keeps an answered call in it."""
    max_new = _budget(served, prompt, req.max_new, "messages" if fmt.chat else "prompt")
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    seed = req.seed
    if session is not None and served.sessions.sampling is not None:  # a training run's:
        temperature, top_p = served.sessions.sampling  # (a fixed seed would make a group's
        seed = None  # episodes sample alike, their advantages zero)
    request = Request(
        tuple(prompt),
        max_new,
        n=req.n,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        top_logprobs=top_logprobs,
        not_before=None if session is None else session[0].not_before,
    )
    generation = _submit(served, request)
    if session is not None and not served.sessions.started(session[0], generation):
        generation.cancel()
        raise APIError(404, "the session ended", "not_found_error", code="session_not_found")
    record.prompt = len(prompt)
    served.metrics.prompt_tokens.inc(len(prompt))
    choices = [ChoiceText(served.tokenizer, req.stops) for _ in range(req.n)]
    if req.stream:
        events = _stream(served, record, req, prompt, generation, choices, fmt, session)
        return _EventStream(events, on_close=generation.cancel)
    collect = asyncio.ensure_future(_collect(generation, choices, record))
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:  # a client gone, or this task cancelled (shutdown): the engine stops at once
        gone.cancel()
        collect.cancel()
        generation.cancel()
        _finished(served, record)
        if session is not None:
            served.sessions.ended(session[0], generation)
    if not collect.done() or collect.cancelled():
        record.note = "client gone"
        return Response(status_code=499)
    if isinstance(collect.exception(), ValueError):
        raise APIError(400, str(collect.exception()))
    if isinstance(collect.exception(), ShuttingDown):
        raise APIError(503, str(collect.exception()), "server_error")
    collect.result()  # anything else the engine raised: a 500, logged
    body = protocol.envelope(
        record.rid,
        fmt.object,
        served.model_name,
        [fmt.choice(i, c) for i, c in enumerate(choices)],
        usage=protocol.usage(len(prompt), record.completion),
    )
    if req.return_token_ids and fmt.chat:
        body["prompt_token_ids"] = prompt
    if session is not None and not session[1](choices, body["choices"][0]["message"], body):
        raise APIError(404, "the session ended before the reply", "not_found_error",
                       code="session_not_found")  # fmt: skip
    return JSONResponse(body, headers={"X-Request-Id": record.rid})


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes (its body is read: the next message says so)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _collect(generation: Generation, choices: list[ChoiceText], record: _Record) -> None:
    async for _ in _deltas(generation, choices, record):
        pass


async def _deltas(
    generation: Generation, choices: list[ChoiceText], record: _Record
) -> AsyncIterator[int]:
    """The index of each choice as a delta reaches it; a stop string cancels its choice."""
    async for delta in generation.deltas():
        choice = choices[delta.index]
        if choice.finish is not None:  # ended by a stop string; this was in flight
            continue
        before = len(choice.ids)
        if choice.add(delta):
            generation.cancel(delta.index)
        record.tokens(len(choice.ids) - before)
        yield delta.index


def _finished(served: _Served, record: _Record) -> None:
    m, now = served.metrics, time.perf_counter()
    m.generated_tokens.inc(record.completion)
    m.seconds.observe(now - record.started)
    if record.first_token is not None:
        m.time_to_first_token.observe(record.first_token - record.started)
        if now > record.first_token and record.completion > 1:
            m.tokens_per_second.observe((record.completion - 1) / (now - record.first_token))


class _EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (a client that goes
    away cancels the stream's task: its generation is cancelled here at once)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _dumped(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


def _sse(data: Any) -> str:
    # ASCII JSON: a sampled U+2028 / U+2029 / U+0085 stays escaped, so a client that splits
    # lines the way Python's str.splitlines does (httpx's aiter_lines) never cuts an event.
    return f"data: {json.dumps(data, ensure_ascii=True)}\n\n"


async def _stream(
    served: _Served,
    record: _Record,
    req,
    prompt: list[int],
    generation: Generation,
    choices: list[ChoiceText],
    fmt: _Format,
    session: tuple[Session, Callable] | None = None,
) -> AsyncIterator[str]:
    """The chunks: a first one per choice (chat: the role), then each delta's, a choice's
    last one with its finish_reason, the usage when asked, `[DONE]`. In a session, a call
    streamed to its end is kept in it."""

    def chunk(parts: list, **extra) -> str:
        if req.include_usage:
            extra.setdefault("usage", None)
        return _sse(
            protocol.envelope(record.rid, fmt.chunk_object, served.model_name, parts, **extra)
        )

    try:
        first = {"prompt_token_ids": prompt} if req.return_token_ids and fmt.chat else {}
        for i in range(req.n) if fmt.chat else ():  # one chunk per choice, as OpenAI's
            yield chunk([fmt.opening(i)], **(first if i == 0 else {}))
        kept = session is None
        async for i in _deltas(generation, choices, record):
            piece = chunk([fmt.piece(i, choices[i])])
            if not kept and choices[0].finish is not None:  # kept before the last piece goes:
                kept = True  # a client may stop reading at its finish_reason
                if not session[1](choices, fmt.choice(0, choices[0])["message"], None):
                    raise ValueError("the session ended before the reply")
            yield piece
        if not kept:  # its generation was cancelled: the session ended
            raise ValueError("the session ended before the reply")
        if req.include_usage:
            yield chunk([], usage=protocol.usage(len(prompt), record.completion))
    except Exception as e:  # noqa: BLE001 - the engine failed mid-stream: say so, then end
        if not isinstance(e, ShuttingDown | ValueError):  # (those say why themselves)
            log.exception("%s failed mid-stream", record.rid)
        kind = "invalid_request_error" if isinstance(e, ValueError) else "server_error"
        record.note = f"error: {e}"
        yield _sse(protocol.error_body(str(e), kind))
    finally:
        _finished(served, record)
        if session is not None:
            served.sessions.ended(session[0], generation)
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------- response shapes


@dataclasses.dataclass
class _Turn:
    """How a chat choice's text splits into reasoning, content and tool calls."""

    family: str
    tools: bool  # tools were offered (and tool_choice is not "none"): calls are parsed
    opened: bool  # the prompt opened a think block
    parallel: bool  # false: only the first call is made
    lead: str = ""  # the turn's start, in the prompt (a forced call's opening): read first

    def parser(self) -> parsers.StreamParser:
        # Without tools a call-shaped text is content, streamed as generated (as `split`).
        parser = parsers.StreamParser(self.family, opened=self.opened, calls=self.tools)
        if self.lead:
            parser.feed(self.lead)  # held: an opened call gives nothing before it closes
        return parser

    def split(self, text: str) -> tuple[str | None, str, list[parsers.Call]]:
        reasoning, content = parsers.split_reasoning(self.lead + text, opened=self.opened)
        if not self.tools:
            return reasoning, content, []
        content, calls = parsers.parse_tool_calls(content, self.family)
        return reasoning, content, calls

    def calls(self, calls, content: str, made: int) -> tuple[list[dict], str]:
        """OpenAI's tool_calls for `calls` (the `made` before them already given), and the
        content with any call that could not be read put back as text."""
        out = []
        for call in calls:
            if isinstance(call, parsers.ToolCall) and self.tools:
                if self.parallel or made + len(out) == 0:
                    out.append(
                        {
                            "id": f"call_{uuid.uuid4().hex[:24]}",
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    )
            elif isinstance(call, parsers.MalformedCall):
                content += call.text
            # (tools not offered: neither `split` nor the stream parses calls)
        return out, content


class _Format(Protocol):
    """A chat or a text completion's shapes."""

    chat: bool
    object: str
    chunk_object: str

    def choice(self, index: int, choice: ChoiceText) -> dict: ...
    def piece(self, index: int, choice: ChoiceText) -> dict: ...
    def opening(self, index: int) -> dict: ...


class _ChatFormat(_Format):
    chat, object, chunk_object = True, "chat.completion", "chat.completion.chunk"

    def __init__(self, served: _Served, req: protocol.ChatRequest, turn: _Turn):
        self.served, self.req, self.turn = served, req, turn
        self.parsers = [turn.parser() for _ in range(req.n)]
        self.made = [0] * req.n  # tool calls streamed per choice

    def _logprobs(self, choice: ChoiceText, span: slice) -> dict | None:
        if not self.req.logprobs:
            return None
        served = self.served

        def entry(token: int, logprob: float) -> dict:
            return {"token": served.token_text(token), "logprob": logprob,
                    "bytes": served.token_bytes(token)}  # fmt: skip

        content = []
        for k in range(span.start, span.stop):
            e = entry(choice.ids[k], choice.logprobs[k])
            e["top_logprobs"] = [entry(i, lp) for i, lp in choice.top[k]] if choice.top else []
            content.append(e)
        return {"content": content}

    def _finish(self, choice: ChoiceText, calls: int) -> str | None:
        if choice.finish == "stop" and calls:
            return "tool_calls"
        return choice.finish

    def choice(self, index: int, choice: ChoiceText) -> dict:
        reasoning, content, calls = self.turn.split(choice.text)
        tool_calls, content = self.turn.calls(calls, content, 0)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
            message["content"] = content or None
        out = {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice, slice(0, len(choice.ids))),
            "finish_reason": self._finish(choice, len(tool_calls)),
        }
        if self.req.return_token_ids:
            out["token_ids"] = choice.ids
        return out

    def opening(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def piece(self, index: int, choice: ChoiceText) -> dict:
        parser, text = self.parsers[index], choice.release()
        parts = [parser.feed(text)] if text else []
        if choice.finish is not None:
            parts.append(parser.finish())
        delta: dict[str, Any] = {}
        reasoning = "".join(p.reasoning for p in parts)
        content = "".join(p.content for p in parts)
        calls, content = self.turn.calls(
            [c for p in parts for c in p.calls], content, self.made[index]
        )
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [
                {"index": self.made[index] + k, **c} for k, c in enumerate(calls)
            ]
            self.made[index] += len(calls)
        span = choice.take_tokens()
        out = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(choice, span),
            "finish_reason": None
            if choice.finish is None
            else self._finish(choice, self.made[index]),
        }
        if self.req.return_token_ids:
            out["token_ids"] = choice.ids[span]
        return out


class _TextFormat(_Format):
    chat, object, chunk_object = False, "text_completion", "text_completion"

    def __init__(self, served: _Served, req: protocol.CompletionRequest, prompt: list[int]):
        self.served, self.req, self.prompt = served, req, prompt
        self.unsent = set(range(req.n))  # choices whose prompt_token_ids are not streamed yet

    def _logprobs(self, choice: ChoiceText, span: slice) -> dict | None:
        if self.req.logprobs is None:
            return None
        text = self.served.token_text
        ids = choice.ids[span]
        return {
            "tokens": [text(i) for i in ids],
            "token_logprobs": choice.logprobs[span],
            "top_logprobs": [{text(i): lp for i, lp in top} for top in choice.top[span]]
            if choice.top
            else None,
            "text_offset": choice.offsets[span],
        }

    def choice(self, index: int, choice: ChoiceText) -> dict:
        out = {
            "index": index,
            "text": choice.text,
            "logprobs": self._logprobs(choice, slice(0, len(choice.ids))),
            "finish_reason": choice.finish,
        }
        if self.req.return_token_ids:  # vLLM's places
            out["prompt_token_ids"], out["token_ids"] = self.prompt, choice.ids
        return out

    def piece(self, index: int, choice: ChoiceText) -> dict:
        text, span = choice.release(), choice.take_tokens()
        out = {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(choice, span),
            "finish_reason": choice.finish,
        }
        if self.req.return_token_ids:
            if index in self.unsent:
                out["prompt_token_ids"] = self.prompt
                self.unsent.discard(index)
            out["token_ids"] = choice.ids[span]
        return out
