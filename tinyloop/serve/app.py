"""The HTTP server: OpenAI-compatible routes over one loaded model (FastAPI; ``tinyloop[serve]``).

Routes: ``POST /v1/completions`` (text or token-id prompts, streaming as server-sent events),
``POST /v1/chat/completions`` (messages rendered by the model's chat template, streamed as chat
chunks),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (the
playground page). Every request is validated by tinyloop itself before it is queued (a
TinyLoopError or a malformed body is a 400 naming the field; an unknown model a 404; a full queue
a 429 with Retry-After); one ModelWorker drains the queue (tinyloop.serve.worker)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ..errors import (ConfigError, HandleFreedError, IncompatibleModesError, InvalidInputError, ModelFreedError,
                      PluginError, TinyLoopError, TokenizerError)
from ..runtime.config import GenerateStats
from ..runtime.engine import encode_text
from .config import ServeConfig
from .worker import DEADLINE, EventBox, Job, ModelWorker, QueueFullError, ShuttingDownError

try:
    import fastapi
    import prometheus_client  # noqa: F401
except ImportError as _exc:                     # tinyloop.serve.create_app turns this into a ConfigError
    raise ImportError(f"the server needs the serve extra: pip install 'tinyloop[serve]' ({_exc})") from None

from .schema import (ChatChoice, ChatCompletion, ChatCompletionRequest, ChatReply, ChoiceStats, Choice,  # noqa: E402
                     Completion, CompletionRequest, ErrorResponse, FieldError, ModelCard, ModelList, Usage,
                     check_text, generate_config, stops_of)


# =============================================================================== the served model
@dataclass
class Served:
    """What one app serves: the model, its worker, the prefix pool of its scaffolds, metrics."""

    cfg: ServeConfig
    model: Any
    name: str
    worker: ModelWorker
    pool: Any
    metrics: Any
    created: int

    owns_model: bool = True

    def close(self) -> None:
        """Stop the worker (queued requests fail with a 503), free the pool and, when the server
        loaded it, the model: now, or as the running request ends when it outlasts the worker's
        stop timeout (it is let finish; close() returns after the timeout). Idempotent."""
        from ..runtime.engine import free_model
        from ..runtime.reuse import free_prefix_pool
        pool, self.pool = self.pool, None
        model = self.model if self.owns_model else None

        def release() -> None:
            # once no request runs: a request that outlasts the worker's stop timeout holds the
            # model (freeing the pool then would be refused as ModelBusyError), so this runs as it ends
            if pool is not None and not pool._freed:
                free_prefix_pool(pool)
            if model is not None and not model._freed:
                free_model(model)
        self.worker.stop(then=release)


class Metrics:
    """The Prometheus metrics of one server (its own registry)."""

    def __init__(self, served_depth, pool_stats):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.core import CounterMetricFamily
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tinyloop_requests", "HTTP requests answered", ["route", "code"], registry=r)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.tokens = Counter("tinyloop_generated_tokens", "Tokens generated", registry=r)
        self.stops = Counter("tinyloop_stop_reasons", "Finished requests by stop reason", ["reason"], registry=r)
        depth = Gauge("tinyloop_queue_depth", "Requests waiting or running", registry=r)
        depth.set_function(served_depth)
        self.ttft = Histogram("tinyloop_time_to_first_token_seconds", "Queueing + prefill until the first token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.token_latency = Histogram("tinyloop_token_latency_seconds", "Time between successive tokens",
                                       buckets=(.0002, .0005, .001, .002, .005, .01, .025, .05, .1, .25, 1),
                                       registry=r)

        class PoolCollector:
            def collect(self):
                s = pool_stats()
                for key, doc in (("hits", "Prefix-pool lookups that reused a scaffold"),
                                 ("misses", "Prefix-pool lookups without a registered prefix"),
                                 ("evictions", "Prefix-pool entries evicted")):
                    fam = CounterMetricFamily(f"tinyloop_prefix_pool_{key}", doc)
                    fam.add_metric([], float(s.get(key, 0)))
                    yield fam
        r.register(PoolCollector())

    def finished(self, job: Job) -> None:
        self.prompt_tokens.inc(job.prompt_len)
        self.tokens.inc(job.stats.tokens_emitted)
        self.stops.labels(str(job.stop_reason or "ERROR")).inc()     # None: the job failed
        if job.first_token_s is not None:
            self.ttft.observe(job.first_token_s)
        for g in job.token_gaps:
            self.token_latency.observe(g)


def _check_scaffolds(cfg: ServeConfig, model=None) -> None:
    """The scaffolds' values that depend on the plugins and the model file, checked before the model
    is loaded (docs/SERVING.md): each cache mode registered, each depth within the model's
    max_loops (read from the file's header; a ConfigError naming ``scaffolds[i].FIELD``)."""
    from ..runtime.plugins import get_plugin_manager
    if not cfg.scaffolds:
        return
    modes = get_plugin_manager().cache_modes()
    for i, s in enumerate(cfg.scaffolds):
        if s.cache_mode not in modes:
            raise ConfigError(f"scaffolds[{i}].cache_mode={s.cache_mode!r} is not a registered cache mode; "
                              f"available: {sorted(modes)}")
    if all(s.loops is None for s in cfg.scaffolds):
        return
    if model is not None:
        max_loops = model.cfg.max_loops
    else:
        from ..model.format import read_header
        from ..models import model_path
        max_loops = read_header(model_path(cfg.model)).config.max_loops
    for i, s in enumerate(cfg.scaffolds):
        if s.loops is not None and s.loops > max_loops:
            raise ConfigError(f"scaffolds[{i}].loops={s.loops} is outside the allowed range [1, {max_loops}] "
                              f"(the model's max_loops)")


def load_served(cfg: ServeConfig, model=None) -> Served:
    """Load the model (unless given), register the scaffolds, start the worker."""
    from ..runtime.engine import free_model, load_model
    from ..runtime.reuse import create_prefix_pool, free_prefix_pool, register_prefix
    own = model is None
    _check_scaffolds(cfg, model)
    if own:
        model = load_model(cfg.model, max_seq_len=cfg.max_seq_len, backend=cfg.backend)
    pool = None
    try:
        if cfg.scaffolds:
            pool = create_prefix_pool(cfg.pool_capacity, cfg.pool_max_bytes)
            for s in cfg.scaffolds:
                register_prefix(pool, model, encode_text(model, s.text), loops=s.loops,
                                cache_mode=s.cache_mode)
    except BaseException:
        if pool is not None:
            free_prefix_pool(pool)
        if own:
            free_model(model)
        raise
    name = cfg.model_name or os.path.splitext(os.path.basename(model.path))[0]
    metrics = Metrics(lambda: worker.depth, lambda: pool.stats() if pool is not None else {})
    worker = ModelWorker(model, cfg.queue_size, metrics.finished)
    return Served(cfg, model, name, worker, pool, metrics, int(time.time()), own)


# =============================================================================== requests
def _finish_reason(reason) -> Optional[str]:
    if reason is None:
        return None
    if str(reason) in ("MAX_TOKENS", "DEADLINE"):
        return "length"
    return "stop"


def _prompts(served: Served, prompt) -> List[Tuple[Optional[str], List[int]]]:
    """(text or None, ids) of each prompt of a request."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise FieldError("prompt", "prompt is empty: give a text, a list of token ids, or a list of either")
    out = []
    for p in prompt:
        text = check_text("prompt", p) if isinstance(p, str) else None
        ids = encode_text(served.model, p) if text is not None else list(p)
        if not ids:
            raise FieldError("prompt", "a prompt encodes to no tokens; give at least one character or id")
        out.append((text, ids))
    return out


def _token_iter(served: Served, ids: List[int], config, stats: GenerateStats):
    """The validated token generator of one prompt: through the prefix pool when the server has
    scaffolds and the request's mode composes with prefix reuse, else plain.

    The auto decoder calibrates (runs requests on the model) on its first request at a depth. Only
    the worker runs requests on the model, so such a request is checked here, as auto and as the
    plain request it may become, and resolved when the worker takes it (in the handler it would
    race the worker's request, or be refused as busy)."""
    from ..runtime.engine import Plan, resolve_loops
    if config.decoder == "auto" and resolve_loops(served.model, config.loops) not in served.model.decoder_choices:
        Plan(served.model, config, "single")
        _start(served, ids, config.replace(decoder=None), GenerateStats()).close()

        def resolved():
            tokens = _start(served, ids, config, stats)
            try:
                yield from tokens
            finally:
                tokens.close()
        return resolved()
    return _start(served, ids, config, stats)


def _start(served: Served, ids: List[int], config, stats: GenerateStats):
    """_token_iter's generator, the request resolved now."""
    from ..runtime.engine import generate_iter
    from ..runtime.reuse import generate_with_pool_iter
    pool = served.pool
    if pool is not None:
        try:
            return generate_with_pool_iter(served.model, pool, ids, config, stats=stats)
        except IncompatibleModesError:
            pass                      # e.g. a speculative request: prefix reuse does not compose
        except HandleFreedError:
            if not pool._freed:
                raise
            # Served.close() freed the pool meanwhile: the request goes on as a plain one and is
            # refused as the server's (503: the worker is stopped, or the model freed)
    return generate_iter(served.model, ids, config, stats=stats)


def _chat_prompt(served: Served, body) -> List[Tuple[Optional[str], List[int]]]:
    """The one prompt of a chat request: its messages rendered by the model's chat template."""
    from ..api import apply_chat_template
    messages = []
    for i, m in enumerate(body.messages):
        if m.audio is not None:
            raise FieldError(f"messages.{i}.audio", "audio is not supported (a text model)")
        if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.function_call)):
            # a template would render None as the text "None"
            raise FieldError(f"messages.{i}.content", f"a {m.role!r} message needs content (a text or a list of "
                                                      f"text parts); only an assistant message with tool_calls "
                                                      f"or function_call may have none")
        d = m.model_dump(exclude_none=True, exclude={"annotations"})
        d["content"] = m.content if not isinstance(m.content, str) else check_text(f"messages.{i}.content", m.content)
        if isinstance(m.content, list):       # OpenAI's content parts: text only, joined by newlines
            texts = []
            for j, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"messages.{i}.content.{j}", f"content part of type {part.get('type')!r}: "
                                                                   f"only {{'type': 'text', 'text': ...}} parts are "
                                                                   f"supported (a text model)")
                texts.append(check_text(f"messages.{i}.content.{j}", part["text"]))
            d["content"] = "\n".join(texts)
        messages.append(d)
    extra = {"tools": body.tools} if body.tools else {}
    ids = apply_chat_template(served.model, messages, add_generation_prompt=True, **extra)
    if not ids:
        raise FieldError("messages", "the chat template renders these messages to no tokens")
    return [(None, ids)]


def _fitted(served: Served, body, config, ids: List[int], chat: bool):
    """The config of one prompt of the request: max_tokens as the client sent it, checked against
    what the prompt leaves of max_seq_len (a FieldError naming the field it sent), or, not sent,
    the server's default capped to what the prompt leaves (as OpenAI's chat completions default
    to the rest of the context), never a refusal for a value the client did not choose."""
    limit, what = served.model.max_seq_len, "messages" if chat else "prompt"
    room = limit - len(ids)
    sent = ("max_tokens" if body.max_tokens is not None else
            "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else None)
    if room < 0 or (room == 0 and sent is None):
        raise FieldError(what, f"the {what} is {len(ids)} tokens, which leaves no room for a completion in this "
                               f"server's max_seq_len={limit}")
    if sent is None:
        return config if config.max_tokens <= room else config.replace(max_tokens=room)
    if config.max_tokens > room:
        raise FieldError(sent, f"{sent}={config.max_tokens} does not fit: the {what} is {len(ids)} tokens and "
                               f"{len(ids)} + {config.max_tokens} exceeds this server's max_seq_len={limit} "
                               f"(at most {room} here)")
    return config


class Request:
    """One HTTP completion request (or chat completion: `chat`): its jobs (one per prompt) and
    their event queues."""

    def __init__(self, served: Served, body, chat: bool = False):
        self.served, self.body, self.chat = served, body, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        config = generate_config(body, served.cfg.max_tokens_default, served.model.cfg.vocab_size)
        stops = stops_of(body)
        prompts = _chat_prompt(served, body) if chat else _prompts(served, body.prompt)
        self.texts = [t for t, _ in prompts]
        self.prompts = [ids for _, ids in prompts]
        configs = [_fitted(served, body, config, ids, chat) for ids in self.prompts]
        timeout = served.cfg.deadline_s if body.timeout is None else min(body.timeout, served.cfg.deadline_s)
        loop = asyncio.get_running_loop()
        self.jobs: List[Job] = []
        self.boxes: List[EventBox] = []
        self.queued = False
        try:
            for ids, fitted in zip(self.prompts, configs):
                stats = GenerateStats()
                tokens = _token_iter(served, ids, fitted, stats)
                box = EventBox(loop)
                job = Job(tokens, stats, box.put, stops, prompt_len=len(ids))
                job.deadline = job.enqueued + timeout
                self.jobs.append(job)
                self.boxes.append(box)
            served.worker.submit(self.jobs)
            self.queued = True
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()
        if self.queued:               # still queued: its slot is freed now, not when the worker reaches it
            self.served.worker.discard(self.jobs)

    def choice_stats(self, i: int):
        job = self.jobs[i]
        st = job.stats
        secs = st.decode_ms / 1e3
        return ChoiceStats(stop_reason=str(job.stop_reason) if job.stop_reason else None,
                           loops_used=st.loops_used, token_loops=list(st.token_loops), decoder=st.decoder, prompt_tokens=len(self.prompts[i]),
                           completion_tokens=st.tokens_emitted, reused_tokens=st.reused_tokens,
                           first_token_ms=st.first_token_ms,
                           tokens_per_s=(st.tokens_emitted - 1) / secs if secs > 0 and st.tokens_emitted > 1 else 0.0)

    async def events(self, i: int) -> List[tuple]:
        """The events of choice i that have arrived (waits for at least one). A request still waiting
        for the worker when its deadline passes ends there, with nothing generated (stop_reason
        DEADLINE; the worker skips it), instead of when the requests ahead of it are done."""
        job, box = self.jobs[i], self.boxes[i]
        while True:
            out = await box.take(None if job.started else job.deadline)
            if out:
                return out
            # the clock first: a worker that takes the job after this look sees the deadline passed too
            if time.perf_counter() >= job.deadline and not job.started:
                job.stop_reason = DEADLINE
                return [("done", DEADLINE)]

    def usage(self):
        p = sum(len(x) for x in self.prompts)
        c = sum(j.stats.tokens_emitted for j in self.jobs)
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def echo(self, i: int) -> str:
        """Prompt i as the client sent it (token-id prompts decoded)."""
        text = self.texts[i]
        return text if text is not None else self.served.model.tokenizer.decode(self.prompts[i])

    async def collect(self) -> List[Tuple[str, Any]]:
        """(text, end event) of every choice, once decoded (a non-streamed response)."""
        out = []
        for i, box in enumerate(self.boxes):
            text = [self.echo(i)] if getattr(self.body, "echo", False) else []
            end = None
            while end is None:
                for ev in await self.events(i):
                    if ev[0] == "text":
                        text.append(ev[1])
                    elif ev[0] == "error":
                        raise ev[1]
                    else:
                        end = ev
            out.append(("".join(text), end))
        return out

    def chunk(self, i: int, text: Optional[str], finish=None, stats=None, first: bool = False) -> str:
        """One server-sent event of choice i: a completion chunk, or for a chat a chat.completion.chunk
        whose delta carries the role first, then text, then nothing beside the finish reason."""
        choice: dict = {"index": i, "logprobs": None, "finish_reason": finish}
        if self.chat:
            obj = "chat.completion.chunk"
            choice["delta"] = ({"role": "assistant", "content": ""} if first else
                               {} if text is None else {"content": text})
        else:
            obj = "text_completion"
            choice["text"] = text or ""
        if stats is not None:
            choice["tinyloop"] = stats.model_dump()
        c = {"id": self.id, "object": obj, "created": self.created, "model": self.served.name, "choices": [choice]}
        return f"data: {json.dumps(c)}\n\n"


def _error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """The OpenAI error object (a 4xx body, or an error event of a stream)."""
    return {"error": {"message": " ".join(message.split()), "type": type_, "param": param, "code": code}}


def _error(status: int, message: str, type_: str, param: Optional[str] = None, headers=None,
           code: Optional[str] = None):
    from fastapi.responses import JSONResponse
    return JSONResponse(_error_body(message, type_, param, code), status_code=status, headers=headers)


def _unknown_model(model: str, served: "Served"):
    """OpenAI's answer to a model it does not serve: 404, invalid_request_error, code model_not_found."""
    return _error(404, f"model {model!r} is not served here (this server serves {served.name!r})",
                  "invalid_request_error", "model", code="model_not_found")


#: The request fields (a TinyLoopError about one names it at its start: ``loops=99 ...``,
#: ``prompt[1]=...``), and GenerateConfig's names of those the body names otherwise.
_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
_CONFIG_NAMES = {"stop_sequences": "stop_token_ids", "sample_seed": "seed"}


def _field_of(message: str) -> Tuple[Optional[str], str]:
    """(param, message) of a tinyloop error: the request field its message starts with (as
    ``name=`` or ``name[``), written as the body names it."""
    m = re.match(r"([A-Za-z_]\w*)(?=[=\[])", message)
    name = m.group(1) if m else None
    if name in _CONFIG_NAMES:
        return _CONFIG_NAMES[name], _CONFIG_NAMES[name] + message[m.end():]
    return (name if name in _REQUEST_FIELDS else None), message


def _tinyloop_error(exc: TinyLoopError, retry_after: int):
    if isinstance(exc, QueueFullError):
        return _error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(retry_after)},
                      code="rate_limit_exceeded")
    if isinstance(exc, (ShuttingDownError, ModelFreedError)):
        # the server stopped (Served.close() frees the model) or its model was freed: not the client's error
        return _error(503, str(exc), "service_unavailable", headers={"Retry-After": str(retry_after)})
    param, message = getattr(exc, "param", None), str(exc)
    if param is None:
        param, message = _field_of(message)
    return _error(400, message, type(exc).__name__, param)


#: Errors of a request's own input (a 400 even when only decoding finds them).
_INPUT_ERRORS = (ConfigError, InvalidInputError, IncompatibleModesError, PluginError, TokenizerError)


def _failed(exc: BaseException, retry_after: int):
    """The response of a request that failed after it was validated and queued: the server's
    failure (5xx: a model freed or a server stopping is 503, a backend error or a bug 500), not
    the client's, unless the error is about the request's own input."""
    if isinstance(exc, _INPUT_ERRORS) or isinstance(exc, (QueueFullError, ShuttingDownError)):
        return _tinyloop_error(exc, retry_after)
    if isinstance(exc, ModelFreedError):
        return _error(503, str(exc), "service_unavailable", headers={"Retry-After": str(retry_after)})
    return _error(500, str(exc) or type(exc).__name__, type(exc).__name__ if isinstance(exc, TinyLoopError)
                  else "server_error")


async def _until_disconnect(http) -> None:
    """Returns when the client of a request whose body has been read goes away (the ASGI server
    answers receive() with http.disconnect then)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


# =============================================================================== the app
#: One server-sent event of a streamed completion, as OpenAPI before 3.2 documents an event
#: stream (the media type's schema describes each event): its data is a JSON chunk (the
#: Completion object with one choice, ``tinyloop`` stats and finish_reason on the choice's last
#: chunk), the usage chunk (stream_options.include_usage), an error body, or ``[DONE]`` last.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "minLength": 1,
                 "description": "a JSON completion chunk, usage chunk or error body; [DONE] ends the stream"},
        "event": {"type": "string", "const": "message"},
    },
}

#: Routes counted by name in tinyloop_requests_total (/v1/models/NAME as "/v1/models/{model}"); any other
#: path counts as "other".
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/", "/openapi.json", "/docs"})


class _CountResponses:
    """ASGI middleware: every HTTP response, by route and status code, as it starts (errors,
    streams and validation failures alike)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)
        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:           # the outer ServerErrorMiddleware answers it: a 500
                self.counter.labels(route, "500").inc()
            raise


class _LimitBody:
    """ASGI middleware: a request body over `limit` bytes (ServeConfig.max_body_bytes) is a 413 with
    an OpenAI error object, before it is parsed or its prompt encoded: at once from its
    Content-Length (nothing of it is read), or, sent chunked, once the bytes read pass the limit
    (the body is read here then, and handed on whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await self._refuse(scope, receive, send, f"{int(length)} bytes")
            return await self.app(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":      # the client went away while sending
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"more than {self.limit} bytes")
            if not message.get("more_body", False):
                break
        body, given = b"".join(parts), False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, size: str):
        response = _error(413, f"the request body is {size}; this server takes at most {self.limit} "
                               f"(max_body_bytes)", "invalid_request_error")
        await response(scope, receive, send)


#: What a request body must be (the routes' 400s for one that is not say so).
_JSON_BODY = "a JSON object as UTF-8 text with Content-Type: application/json"


def _is_json_type(ctype: Optional[str]) -> bool:
    mime = (ctype or "").split(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _json_kind(value) -> str:
    return ("null" if value is None else "a boolean" if isinstance(value, bool) else
            "a number" if isinstance(value, (int, float)) else "a string" if isinstance(value, str) else
            "a list (JSON array)" if isinstance(value, list) else type(value).__name__)


def create_app(cfg: Optional[ServeConfig] = None, model=None):
    """The FastAPI app serving `cfg`'s model (or `model`, already loaded). The model is loaded and the
    scaffolds registered now, so a bad config fails before any socket is opened; the app outlives
    any number of server lifespans (test clients open one per request), and
    ``app.state.served.close()`` stops its worker and frees what it loaded (not a `model` it was
    given)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from ..runtime.engine import Model
    cfg = cfg if cfg is not None else ServeConfig()
    if not isinstance(cfg, ServeConfig):
        raise ConfigError(f"create_app takes a ServeConfig, got {type(cfg).__name__}")
    if model is not None and not isinstance(model, Model):
        raise InvalidInputError(f"model must be a Model from tinyloop.load_model (or None: load cfg.model), "
                                f"got {type(model).__name__}")
    served = load_served(cfg, model)

    app = fastapi.FastAPI(title="TinyLoop", version="0.1.0",
                          description="OpenAI-compatible completions over a weight-shared looped transformer")
    app.state.served = served
    app.add_middleware(_LimitBody, limit=cfg.max_body_bytes)          # inside the counting: a 413 is counted
    app.add_middleware(_CountResponses, counter=served.metrics.requests)
    errors = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
              503: {"model": ErrorResponse, "description": "The server is stopping (or its model was freed)"},
              200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                    "description": "A completion (JSON), or with stream=true server-sent events"}}

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'malformed')}); "
                               f"send {_JSON_BODY}", "invalid_request_error")
        if tuple(first.get("loc", ())) == ("body",):          # the body as a whole
            ctype = request.headers.get("content-type")
            if first.get("type") == "missing":
                return _error(400, f"the body is empty; send {_JSON_BODY}", "invalid_request_error")
            if not _is_json_type(ctype):
                sent = f"with Content-Type {ctype!r}" if ctype else "without a Content-Type"
                return _error(400, f"the body was sent {sent}; send {_JSON_BODY}", "invalid_request_error")
            if first.get("type") in ("model_attributes_type", "dict_type"):
                return _error(400, f"the body must be a JSON object ({{...}}), got {_json_kind(first.get('input'))}",
                              "invalid_request_error")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                        for e in exc.errors()[:5])
        return _error(400, msg or "malformed request", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        """Starlette's own answers (an unknown route 404, a wrong method 405; a 400: FastAPI could not
        read the body, e.g. bytes that are not UTF-8) as OpenAI error objects."""
        message = str(exc.detail) if exc.status_code != 400 else f"{exc.detail}: send {_JSON_BODY}"
        return _error(exc.status_code, message, "invalid_request_error", headers=exc.headers)

    @app.exception_handler(TinyLoopError)
    async def tinyloop_error(request, exc):
        return _tinyloop_error(exc, cfg.retry_after_s)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "backend": served.model.backend_name,
                "queue_depth": served.worker.depth, "pid": os.getpid()}

    def card() -> ModelCard:
        c = served.model.cfg
        return ModelCard(id=served.name, created=served.created, max_seq_len=served.model.max_seq_len,
                         max_loops=c.max_loops, default_loops=c.default_loops, backend=served.model.backend_name)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model_card(model: str):
        if model != served.name:
            return _unknown_model(model, served)
        return card()

    # a model id with a slash ("org/name"): the client percent-encodes it, the ASGI server decodes
    # it into two path segments, which the route above does not match
    app.get("/v1/models/{model:path}", response_model=ModelCard, include_in_schema=False)(model_card)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        path = os.path.join(os.path.dirname(__file__), "static", "playground.html")
        with open(path, encoding="utf-8") as fh:
            return HTMLResponse(fh.read())

    async def respond(body, chat: bool, http):
        """Both routes: the model check, then a stream of server-sent events, or the decoded
        choices in a Completion (chat: a ChatCompletion). A non-streamed request whose client
        goes away is cancelled (its jobs stop within one token, or never start)."""
        if body.model != served.name:
            return _unknown_model(body.model, served)
        req = Request(served, body, chat=chat)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(req, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        work = asyncio.ensure_future(req.collect())
        gone = asyncio.ensure_future(_until_disconnect(http))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            req.cancel()              # a disconnect (or a cancelled handler) stops its jobs
            gone.cancel()
            left = not work.done()
            if left:
                work.cancel()
        if left:                      # nobody reads this answer: 499, as proxies log a client that left
            return _error(499, "the client closed the connection before the completion was ready",
                          "client_closed_request")
        if work.exception() is not None:
            return _failed(work.exception(), cfg.retry_after_s)
        done = work.result()
        choices = [(ChatChoice(message=ChatReply(content=text), index=i, finish_reason=_finish_reason(end[1]),
                               tinyloop=req.choice_stats(i)) if chat else
                    Choice(text=text, index=i, finish_reason=_finish_reason(end[1]), tinyloop=req.choice_stats(i)))
                   for i, (text, end) in enumerate(done)]
        reply = ChatCompletion if chat else Completion
        return JSONResponse(reply(id=req.id, created=req.created, model=served.name, choices=choices,
                                  usage=req.usage()).model_dump())

    @app.post("/v1/completions", response_model=Completion, responses=errors)
    async def completions(body: CompletionRequest, http: fastapi.Request):
        return await respond(body, False, http)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=errors)
    async def chat_completions(body: ChatCompletionRequest, http: fastapi.Request):
        return await respond(body, True, http)

    async def _sse(req: Request, include_usage: bool):
        chunk = req.chunk
        failed = False
        try:
            for i, box in enumerate(req.boxes):
                if req.chat:
                    yield chunk(i, None, first=True)
                elif req.body.echo:
                    yield chunk(i, req.echo(i))
                ended = False
                while not ended:
                    out = []
                    for ev in await req.events(i):
                        if ev[0] == "text":
                            out.append(chunk(i, ev[1]))      # one chunk per token, "" while a character is incomplete
                        elif ev[0] == "error":
                            out.append(f"data: {json.dumps(_error_body(str(ev[1]), type(ev[1]).__name__))}\n\n")
                            ended = failed = True
                        else:
                            out.append(chunk(i, None, _finish_reason(ev[1]), req.choice_stats(i)))
                            ended = True
                    yield "".join(out)
                if failed:
                    # the request failed (a non-streamed one is a 5xx): its other prompts are not
                    # decoded, and neither they nor a usage chunk follow the error event
                    req.cancel()
                    break
            if include_usage and not failed:
                u = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
                     "created": req.created, "model": served.name, "choices": [], "usage": req.usage().model_dump()}
                yield f"data: {json.dumps(u)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            req.cancel()              # the client went away (or the stream ended): stop decoding

    return app


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, **config):
    """A uvicorn.Server for `app` (create_app's) whose shutdown (SIGINT / SIGTERM, or
    ``should_exit``) stops the served worker first: the requests still queued fail with a 503 (an
    error event when streamed) and the running one is let finish, as Served.close() documents,
    instead of uvicorn waiting for every open connection, so for every queued request to be
    decoded in full, before anything is closed. ``python -m tinyloop serve`` runs this."""
    import uvicorn

    served = app.state.served

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # close() blocks (it waits a while for the running request): off the event loop, which
            # must go on streaming that request and answering the 503s
            closing = asyncio.get_running_loop().run_in_executor(None, served.close)
            try:
                await super().shutdown(sockets)
            finally:
                await closing

    return Server(uvicorn.Config(app, host=host, port=port, **config))
