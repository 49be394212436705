"""The OpenAI-compatible HTTP API over an `EngineWorker` (FastAPI; server-sent events for streaming).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (Prometheus text).

Per request: ``model`` (optional, as vLLM's), ``temperature`` (0..2; omitted: the server's ``--temperature``),
``top_p`` (0..1], ``seed`` (any integer, taken modulo 2**31), ``max_tokens`` (chat also
``max_completion_tokens``), ``stop`` (strings: the text is cut before the first one, as OpenAI does),
``stop_token_ids`` and ``ignore_eos`` (as vLLM's), ``stream`` with ``stream_options.include_usage``; chat also
``chat_template_kwargs`` and ``add_generation_prompt`` (as vLLM's) and a ``name`` per message, passed to the
template; ``n`` must be 1. Logprobs: chat ``logprobs`` (true) with ``top_logprobs`` (0..20) gives
``choices[].logprobs.content``; completions ``logprobs`` (0..20) gives ``{tokens, token_logprobs, top_logprobs,
text_offset}``, and ``echo`` puts the prompt before the answer (with ``logprobs``, the prompt's tokens too, the
first one's null); streamed, each chunk carries its own tokens' logprobs. They are the target's raw
log-probabilities (``log_softmax`` of its logits, at temperature 1 without top-p and before any grammar: vLLM's
default ``raw_logprobs``), whatever the request samples at (`dspark_jax.serve.logprobs`). Structured output (one
constraint a request, exact under speculation: `dspark_jax.grammar`): ``response_format``
``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar`` in llguidance's Lark dialect,
``json_object``) and its older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; a
constraint that does not compile is a 400 naming the field (code ``invalid_grammar``) before any work. Chat takes
``tools``, ``tool_choice`` and ``parallel_tool_calls`` and tool turns (`dspark_jax.serve.tools`: ``required`` and
a named function forced by a grammar for every model, ``auto`` only where the template renders tools in a syntax
parsed here). A field that would change the answer in a way this server cannot do is refused by name (400, code
``unsupported_parameter``) unless it holds its neutral value: chat's ``echo``, vLLM's ``prompt_logprobs``,
completions' ``tools``, penalties, ``logit_bias``, ``top_k``, ``min_p``, ``min_tokens``, ``best_of``,
``suffix``, ``functions``, ``continue_final_message``. Fields that
do not change the answer (``user``, ``metadata``, ...) are ignored. Errors are OpenAI's shape, ``{"error":
{"message", "type", "param", "code"}}``: 400 for a bad body (not a JSON object, text that is not valid Unicode,
a value out of range or not finite, a prompt longer than ``--max-prompt-tokens`` or the context, a conversation
the chat template refuses; ``param`` names the field), 401 without the ``--api-key`` (every path but
``/health``; ``OPTIONS`` requests, which browsers send as CORS preflights without credentials, pass), 404 for an
unknown model, 408 for a body slower than the body timeout, 413 for a body over the size limit, 429 when the
queue is full, 503 when shutting down or after the queue timeout.

Request bodies are bounded in size and time (`_BodyGuard`), connections in number and in the time their headers
take (`server_config`); parsing, validation, chat templates and tokenizing run on a thread pool, off the event
loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, ClassVar, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark_jax.engine import MAX_SEED, SamplingParams
from dspark_jax.grammar import grammar_tokenizer
from dspark_jax.serve.tools import ToolError, calls_as_text, parse_calls, plan_tools, template_turn_calls
from dspark_jax.sampling import MAX_LOGPROBS
from dspark_jax.serve.logprobs import LogprobFormat, text_offsets
from dspark_jax.serve.worker import EngineWorker, Event, GenerationRequest, QueueFull, ShuttingDown, prometheus_text
from dspark_jax.tokenizer import TooManyTokens

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextStream", "create_app",
           "BackgroundServer", "server_config", "parse_body"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    # Undeclared fields are kept (`model_extra`) so that `unsupported` can refuse those in `_NEUTRAL` that ask for
    # something; the rest (``user``, ``metadata``, ...) change nothing in the answer and are not read.
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # omitted: the served model (as vLLM)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # NaN (Python's json): refused
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None  # any integer, reduced modulo 2**31 (OpenAI's seeds are 64-bit, signed)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=1, description="only one choice per request")
    # Refused when asked for (see `unsupported`); accepted at their "off" values, which clients send by default.
    echo: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def logprobs_asked(self) -> int | None:
        """Top alternatives per output token the request asks for with its logprobs, None: no logprobs."""
        raise NotImplementedError

    def unsupported(self) -> str | None:
        """The first field asking for something this server does not do, else None."""
        if self.echo and self._chat:
            return "echo"
        if self.tools and not self._chat:
            return "tools"
        extra = self.model_extra or {}  # fields this model does not declare, kept to be checked here
        for name, neutral in _NEUTRAL.items():
            value = extra.get(name)
            if value is not None and value not in neutral:
                return name
        return None

    _chat: ClassVar[bool] = False


# Fields of OpenAI's and vLLM's APIs that change the answer and that this server does not implement, with the
# values that ask for nothing (what clients send by default): any other value is refused, so a client never gets
# an answer it did not ask for.
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "top_k": (0, -1), "min_p": (0, 0.0), "min_tokens": (0,), "best_of": (1,),
    "suffix": ("",), "functions": ([],), "function_call": ("none",), "continue_final_message": (False,),
    "guided_whitespace_pattern": (), "guided_decoding_backend": (),
    # vLLM's prompt logprobs in its own shape (completions' echo with logprobs gives them in OpenAI's) and its
    # token-id strings
    "prompt_logprobs": (), "return_tokens_as_token_ids": (False,),
}

# vLLM's structured-output fields: ``structured_outputs`` keys and the older top-level ``guided_*`` fields, each to
# the `grammar.Grammar` constructor it asks for
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark",
                    "json_object": "json_object"}
_GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "lark"}


def structured_output(body: "_Sampling") -> tuple[str, str, Any] | None:
    """The constraint a request asks for, as (param, kind, argument) with kind a `grammar.Grammar` constructor, or
    None:
    ``response_format`` ``json_object`` / ``json_schema`` (OpenAI's), ``structured_outputs`` (vLLM's: one of
    ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or vLLM's older ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one of them.

    Raises:
      APIError: 400 naming the field for a malformed or second constraint.
    """
    asked: list[tuple[str, str, Any]] = []  # (param, kind, argument)
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            asked.append(("response_format", "json_object", None))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema: expected an object with a JSON schema in "
                                    "'schema' (and a 'name')", param="response_format.json_schema")
            asked.append(("response_format.json_schema.schema", "json_schema", spec.get("schema", {})))
        elif kind != "text":
            raise APIError(400, f"response_format.type: expected 'text', 'json_object' or 'json_schema', got "
                                f"{kind!r}", param="response_format.type")
    extra = body.model_extra or {}
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs: expected an object", param="structured_outputs")
        for key, value in so.items():
            if key not in _STRUCTURED_KEYS:
                raise APIError(400, f"structured_outputs.{key}: not supported by this server (one of "
                                    f"{', '.join(_STRUCTURED_KEYS)})", param=f"structured_outputs.{key}",
                               code="unsupported_parameter")
            if value is not None and value is not False:
                asked.append((f"structured_outputs.{key}", _STRUCTURED_KEYS[key],
                              None if key == "json_object" else value))
    for field, kind in _GUIDED_FIELDS.items():
        if extra.get(field) is not None:
            asked.append((field, kind, extra[field]))
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: one output constraint per request ({asked[0][0]} is set too)",
                       param=asked[1][0])
    return asked[0] if asked else None


def build_constraint(param: str, kind: str, arg: Any, grammar_tokenizer):
    """A `grammar.Grammar` for ``structured_output``'s answer; 400 naming ``param`` when it does not compile."""
    from dspark_jax.grammar import Grammar, GrammarError  # noqa: PLC0415

    try:
        if kind == "json_object":
            return Grammar.json_object(grammar_tokenizer)
        return getattr(Grammar, kind)(arg, grammar_tokenizer)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None


# render_chat_template's own arguments: a chat_template_kwargs key of these names is refused
_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "special_tokens", "tools", "documents"})


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text or token ids (a list of one of them is taken as it)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # the most likely alternatives per token (0..20), with each token's own logprob; None: no logprobs
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """A turn: ``developer`` is taken as ``system``; an assistant turn may have no content (null)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Qwen3's {"enable_thinking": false}
    add_generation_prompt: bool = True
    tool_choice: str | dict[str, Any] | None = None  # `serve.tools`
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)  # alternatives, with logprobs
    _chat: ClassVar[bool] = True

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class APIError(Exception):
    """An error answered in OpenAI's shape; ``close``: the connection is closed after the answer (a body that
    was not read to its end)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close


def _error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                    close: bool = False):
    # ASCII JSON: a message or param may quote the request's text, which need not be valid Unicode
    return Response(json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}),
                    status_code=status, media_type="application/json",
                    headers={"Connection": "close"} if close else None)


# The server's limits on what clients send (the flags of `python -m dspark_jax.serve`).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # --max-request-body-bytes: 16 MiB (a million-token prompt as ids)
DEFAULT_REQUEST_HEADER_TIMEOUT = 30.0  # --request-header-timeout: seconds for a request's headers to arrive
DEFAULT_REQUEST_BODY_TIMEOUT = 60.0  # --request-body-timeout: seconds from the headers to the body's end
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # --timeout-keep-alive: an idle kept-alive connection is closed (uvicorn's 5 s)
DEFAULT_MAX_CONNECTIONS = 512  # --max-connections: open connections (or requests in flight) before 503s

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # where json.loads can make one: a \uD800-\uDFFF escape


def _surrogate_at(value: Any, path: tuple = ()) -> tuple | None:
    """The path of the first string (or object key) in ``value`` holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE.search(k):
                return (*path, k)
            found = _surrogate_at(v, (*path, k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_at(v, (*path, i))
            if found is not None:
                return found
    return None


def _printable(part: Any) -> str:
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", str(part))


def _validation_error(errors: Sequence[dict]) -> APIError:
    """pydantic's first error as a 400 naming the request's field."""
    first = errors[0] if errors else {}
    loc = [_printable(p) for p in _field_path(first.get("loc", ()))]
    kind = first.get("type", "")
    msg = ("the body is not valid JSON" if kind == "json_invalid" else
           "not a finite number" if kind == "finite_number" else first.get("msg", "invalid request"))
    return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None)


def parse_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """A request body as ``schema``: JSON (UTF-8) holding an object whose text is valid Unicode.

    >>> parse_body(b'{"prompt": "Hi", "temperature": 0}', CompletionRequest).prompt
    'Hi'
    >>> for raw in (b'{"prompt": "Hi",', b'{"prompt": "\\\\ud800 Hi"}', b'{"prompt": "Hi", "top_p": NaN}'):
    ...     try:
    ...         parse_body(raw, CompletionRequest)
    ...     except APIError as e:
    ...         print(e.status, e.param, '|', e.message)
    400 None | the body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 17 (char 16)
    400 prompt | prompt: not valid Unicode text (a lone surrogate, such as \\ud800)
    400 top_p | top_p: not a finite number

    Raises:
      APIError: 400, naming the field where there is one.
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8 (UnicodeDecodeError)
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            at = _surrogate_at(data)
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        if at is not None:
            field = ".".join(_printable(p) for p in at)
            raise APIError(400, f"{field}: not valid Unicode text (a lone surrogate, such as \\ud800)", param=field,
                           code="invalid_text")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


class TextStream:
    """Token ids -> text deltas for one answer: never half a UTF-8 character, no text of stop tokens, and cut
    before the first stop string (text that could begin one is held back until it cannot).

    >>> class Chars:  # a stand-in tokenizer: token i is the character chr(i)
    ...     def stream(self, skip_special=True, context=()):
    ...         return type("D", (), {"push": lambda self, t: chr(t), "flush": lambda self: ""})()
    >>> s = TextStream(Chars(), stop=["cd"], hidden_ids=())
    >>> s.push([ord(c) for c in "abc"]), s.push([ord("d"), ord("e")]), s.stopped, s.tokens
    ('ab', '', True, 4)
    """

    def __init__(self, tokenizer, stop: Sequence[str], hidden_ids: Sequence[int], context: Sequence[int] = ()):
        self._dec = tokenizer.stream(context=context)
        self._stop = [s for s in stop if s]
        self._hidden = frozenset(int(t) for t in hidden_ids)
        self.text = ""  # the answer's text so far (cut at a stop string)
        self._sent = 0  # characters returned
        self.stopped = False  # a stop string was found
        self.tokens = 0  # tokens consumed (up to the one that completed a stop string)

    def _find_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def push(self, ids: Sequence[int]) -> str:
        """Take the next tokens; returns the text now settled."""
        for t in ids:
            if self.stopped:
                break
            self.tokens += 1
            if int(t) in self._hidden:
                continue
            before = len(self.text)
            self.text += self._dec.push(int(t))
            if self._stop:
                self._find_stop(max(0, before - max(len(s) for s in self._stop)))
        hold = 0
        if not self.stopped:  # a tail that may become a stop string stays back
            for s in self._stop:
                for k in range(min(len(s) - 1, len(self.text) - self._sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        out = self.text[self._sent: len(self.text) - hold]
        self._sent += len(out)
        return out

    def finish(self) -> str:
        """The rest of the text once the answer has ended."""
        if not self.stopped:
            before = len(self.text)
            self.text += self._dec.flush()
            if self._stop:
                self._find_stop(max(0, before - max(len(s) for s in self._stop)))
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out


def create_app(worker: EngineWorker, tokenizer, model_name: str, *, api_key: str | None = None,
               default_max_tokens: int = 256, allowed_origins: Sequence[str] = (),
               max_prompt_tokens: int | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               request_body_timeout: float | None = DEFAULT_REQUEST_BODY_TIMEOUT,
               cpu_threads: int | None = None) -> FastAPI:
    """The FastAPI application serving ``worker``'s engine under the name ``model_name``.

    Args:
      worker: the engine thread (started and drained by the app's lifespan when not already running).
      tokenizer: the target's tokenizer (`dspark_jax.tokenizer.Tokenizer`): text, chat template, stop ids.
      model_name: the id clients pass as ``model``.
      api_key: when set, every request but ``/health`` and CORS preflights needs ``Authorization: Bearer
        <api_key>`` (else 401).
      default_max_tokens: the output budget of a request that gives none (capped by the context left).
      allowed_origins: browser origins allowed to call the API (CORS; ``"*"``: any); none: same-origin only.
      max_prompt_tokens: the longest prompt taken (None: what the context holds with one output token).
      max_request_body_bytes: the largest request body (413 past it: a larger Content-Length before the body is
        read, a body without one as soon as it has grown past it).
      request_body_timeout: seconds from a request's headers to its body's end (408 past it; None: no limit).
      cpu_threads: threads that parse, validate, template and tokenize request bodies, off the event loop
        (default: up to 4, one per core).
    """
    engine = worker.engine
    capacity = engine.cfg.capacity - engine.G - 1  # prompt + output tokens a slot holds
    longest_prompt = capacity - 1 if max_prompt_tokens is None else min(int(max_prompt_tokens), capacity - 1)
    created = int(time.time())
    formats = LogprobFormat(tokenizer)  # token strings for logprobs, each made once
    pool = concurrent.futures.ThreadPoolExecutor(cpu_threads or max(1, min(4, os.cpu_count() or 1)),
                                                 thread_name_prefix="dspark-http-cpu")

    async def off_loop(fn, *args):
        """``fn(*args)`` on the CPU pool: the event loop keeps answering (``/health``, streams) meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        started_here = not worker.alive
        if started_here:
            worker.start()
        yield
        await asyncio.to_thread(worker.stop)  # drains what was accepted
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dspark-jax", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        e = _validation_error(exc.errors())
        return _error_response(e.status, e.message, param=e.param)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code, close=exc.close)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        return _error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                               "invalid_request_error" if exc.status_code < 500 else "server_error")

    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key)
    # outside the key check: an answer that leaves a body unread (a 401) closes the connection
    app.add_middleware(_BodyGuard, max_bytes=max_request_body_bytes, timeout=request_body_timeout)
    if allowed_origins:  # added last, so it runs first: a preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health():
        if not worker.alive:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse("ok")

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "dspark-jax",
            "max_model_len": capacity}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    def check_model(model: str | None) -> None:
        # the served name, or a Hugging Face id ending in it ("HuggingFaceTB/SmolLM2-135M-Instruct"); none: it
        if model is not None and model != model_name and model.rsplit("/", 1)[-1] != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str):
        check_model(model)
        return card

    @app.get("/metrics")
    async def metrics():
        extra = {"dspark_slots": engine.cfg.num_slots, "dspark_queue_limit": worker.max_queued}
        return PlainTextResponse(prometheus_text(worker.metrics(), model_name, extra),
                                 media_type="text/plain; version=0.0.4")

    stops = [int(t) for t in engine.stop_ids if t >= 0]

    def constraint(body: _Sampling):
        """The request's output constraint (`grammar.Grammar`) or None; 400 naming the field when it is malformed."""
        asked = structured_output(body)
        if asked is None:
            return None
        return build_constraint(*asked, grammar_tokenizer(tokenizer, engine.target.cfg.vocab_size, stops))

    def check_request(body: _Sampling):
        check_model(body.model)
        field = body.unsupported()
        if field is not None:
            raise APIError(400, f"{field}: not supported by this server (leave it unset)", param=field,
                           code="unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only with stream = true", param="stream_options")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: only with logprobs = true", param="top_logprobs")

    def prompt_too_long(field: str, count: str) -> APIError:
        limit = (f"this model's context holds {capacity} tokens, so a prompt at most {capacity - 1}"
                 if longest_prompt == capacity - 1 else
                 f"this server takes prompts of at most {longest_prompt} tokens (--max-prompt-tokens)")
        what = "the conversation (chat template applied)" if field == "messages" else "the prompt"
        return APIError(400, f"{field}: {what} has {count} tokens; {limit}", param=field,
                        code="context_length_exceeded")

    def encode(text: str, field: str, add_special: bool) -> list[int]:
        try:
            # a longer text is refused before its ids are listed; the encoding releases the interpreter lock
            return tokenizer.encode(text, add_special=add_special, max_tokens=longest_prompt)
        except TooManyTokens as e:
            count = f"{e.count}" if not add_special else f"at least {e.count}"
            raise prompt_too_long(field, count) from None

    def make_request(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, prompt_field: str = "prompt",
                     limit_field: str = "max_tokens", constrained=None) -> tuple[GenerationRequest, list[str]]:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=prompt_field)
        n = len(prompt_ids)
        if n > longest_prompt:
            raise prompt_too_long(prompt_field, str(n))
        room = capacity - n
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        if max_tokens > room:
            raise APIError(400, f"{limit_field}: this model's context holds {capacity} tokens; the prompt has {n}, "
                                f"which leaves {room} for the answer, and {limit_field} asks for {max_tokens}",
                           param=limit_field, code="context_length_exceeded")
        vocab = tokenizer.vocab_size
        stop_ids = tuple(body.stop_token_ids or ())
        bad = [t for t in stop_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"stop_token_ids: token ids must lie in [0, {vocab}), got {bad}",
                           param="stop_token_ids")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = None if body.seed is None else body.seed % (MAX_SEED + 1)
        top_n = body.logprobs_asked()
        sampling = SamplingParams(temperature=body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                  seed=seed, stop_token_ids=stop_ids, ignore_eos=bool(body.ignore_eos),
                                  grammar=constrained, logprobs=top_n,
                                  prompt_logprobs=top_n if body.echo else None)
        return GenerationRequest(prompt_ids, int(max_tokens), sampling), stop

    async def run(request: Request, body: _Sampling, prompt_ids: list[int], max_tokens: int | None, chat: bool,
                  constrained=None, tools=None):
        limit_field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        req, stop = make_request(body, prompt_ids, max_tokens, "messages" if chat else "prompt", limit_field,
                                 constrained)
        try:
            events = worker.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None
        hidden = set(int(t) for t in engine.stop_ids) | set(req.sampling.stop_token_ids)
        text = TextStream(tokenizer, stop, hidden, context=prompt_ids)  # the prompt's tail: a leading space kept
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        started = int(time.time())  # every chunk of the answer carries the same `created`
        first = await _next_event(request, events, worker, req)
        if first is None:
            return JSONResponse({}, status_code=499)
        if first.kind == "error":
            raise APIError(first.status, first.message, "server_error" if first.status >= 500 else
                           "invalid_request_error")
        with_logprobs = req.sampling.logprobs is not None
        # completions' echo: the prompt as sent (token ids: their text, special tokens included) before the answer
        echo = ""
        if not chat and body.echo:
            prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) \
                else body.prompt
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special=False)

        def usage():
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": text.tokens,
                    "total_tokens": len(prompt_ids) + text.tokens}

        def logprobs_of(ids: list[int], entries: list, offsets: list[int], empty: bool = False) -> dict | None:
            """The choice's ``logprobs`` for some tokens (None without logprobs, or for no tokens unless
            ``empty``)."""
            if not with_logprobs or not (ids or empty):
                return None
            return {"content": formats.chat(entries)} if chat else formats.completion(ids, entries, offsets)

        def echoed(event: Event) -> tuple[str, dict | None]:
            """The echoed prompt and, with logprobs, its tokens' (the first event carries them)."""
            if not with_logprobs:
                return echo, None
            entries = list(event.prompt_logprobs or [None] * len(prompt_ids))
            offsets = text_offsets([formats.piece(t) for t in prompt_ids])
            return echo, formats.completion(prompt_ids, entries, offsets)

        failure: list[Event] = []  # the engine's error event, when the answer ends with one

        async def answer():
            """(text delta, finish reason or None, (token ids, logprobs, text offsets) of the tokens since the last
            yield) as the engine commits tokens; ends after the reason. Every token consumed (up to the one that
            ends the answer) is in exactly one yield, its logprobs with it."""
            event = first
            ids, entries, offsets = [], [], []

            def taken():
                out = (list(ids), list(entries), list(offsets))
                ids.clear(), entries.clear(), offsets.clear()
                return out

            while True:
                if event is None:  # the client left
                    return
                if event.kind == "error":
                    failure.append(event)
                    yield text.finish(), "error", taken()
                    return
                if event.kind == "tokens":
                    for j, token in enumerate(event.tokens):  # one chunk per token, as the round committed them
                        offset = len(echo) + len(text.text)
                        delta = text.push([token])
                        if with_logprobs:
                            ids.append(token)
                            entries.append(event.logprobs[j])
                            offsets.append(offset)
                        if text.stopped:
                            worker.cancel(req, "stop")
                            yield delta, "stop", taken()
                            return
                        if delta:
                            yield delta, None, taken()
                if event.kind == "done":
                    rest = text.finish()  # may complete a stop string held back until now
                    yield rest, "stop" if text.stopped else event.finish_reason, taken()
                    return
                event = await _next_event(request, events, worker, req)

        if not body.stream:
            parts, reason = [], None
            all_ids, all_entries, all_offsets = [], [], []
            async for delta, reason, (ids, entries, offsets) in answer():
                parts.append(delta)
                all_ids += ids
                all_entries += entries
                all_offsets += offsets
            if reason is None:
                return JSONResponse({}, status_code=499)
            if failure:  # the engine failed mid-answer: an error, not a truncated answer
                raise APIError(failure[0].status, failure[0].message, "server_error")
            content = "".join(parts)
            logprobs = logprobs_of(all_ids, all_entries, all_offsets, empty=True)
            if echo:
                content = echo + content
                if logprobs is not None:
                    head = echoed(first)[1]
                    logprobs = {k: head[k] + logprobs[k] for k in head}
            message = {"role": "assistant", "content": content}
            if tools is not None:  # the answer's calls (`serve.tools.parse_calls`)
                content, calls = parse_calls(tools, content)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            choice = ({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason} if chat else
                      {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": started,
                    "model": model_name, "choices": [choice], "usage": usage()}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None, role: bool = False, calls: list | None = None,
                  logprobs: dict | None = None) -> str:
            if chat:
                d = {} if delta is None else {"content": delta}
                if calls:
                    d["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                if role:
                    d["role"] = "assistant"
                choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
            out = {"id": rid, "object": obj, "created": started, "model": model_name, "choices": [choice]}
            if include_usage:
                out["usage"] = None  # as OpenAI: null on every chunk but the last
            return _sse(out)

        async def stream():
            finished = False
            try:
                if chat:
                    yield chunk("", None, role=True)
                if echo:
                    prompt_text, prompt_logprobs = echoed(first)
                    yield chunk(prompt_text, None, logprobs=prompt_logprobs)
                held, held_ids, held_entries, held_offsets = [], [], [], []  # with tools: parsed once whole
                async for delta, reason, (ids, entries, offsets) in answer():
                    if tools is None:
                        logprobs = logprobs_of(ids, entries, offsets)
                        if delta:
                            yield chunk(delta, None, logprobs=logprobs)
                            logprobs = None
                    else:
                        held.append(delta or "")
                        held_ids += ids
                        held_entries += entries
                        held_offsets += offsets
                        logprobs = None
                        if reason is not None and not failure:
                            logprobs = logprobs_of(held_ids, held_entries, held_offsets)
                            content, calls = parse_calls(tools, "".join(held))
                            if calls:
                                yield chunk(content, None, calls=calls, logprobs=logprobs)
                                reason = "tool_calls" if reason == "stop" else reason
                                logprobs = None
                            elif content:
                                yield chunk(content, None, logprobs=logprobs)
                                logprobs = None
                    if failure:  # mid-stream: an error event in OpenAI's shape, then the end of the stream
                        err = failure[0]
                        yield _sse({"error": {"message": err.message, "type": "server_error", "param": None,
                                              "code": None}})
                        finished = True
                    elif reason is not None:
                        yield chunk(None if chat else "", reason, logprobs=logprobs)
                        finished = True
                if include_usage:
                    yield _sse({"id": rid, "object": obj, "created": started, "model": model_name,
                                "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client left mid-stream: free its slot
                    worker.cancel(req)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def read_body(request: Request) -> bytes:
        try:
            return await request.body()  # bounded in size and time by _BodyGuard
        except ClientDisconnect:
            raise APIError(400, "the client closed the connection before the body ended", close=True) from None

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[int], Any]:
        """The request, its prompt's ids and its output constraint (on the CPU pool)."""
        body = parse_body(raw, CompletionRequest)
        check_request(body)
        constrained = constraint(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of one string or token list)",
                               param="prompt")
            prompt = prompt[0]
        ids = encode(prompt, "prompt", add_special=True) if isinstance(prompt, str) else [int(t) for t in prompt]
        return body, ids, constrained

    def prepare_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[int], Any, Any]:
        """The request, its templated conversation's ids, its output constraint and its tool plan (on the CPU
        pool)."""
        body = parse_body(raw, ChatCompletionRequest)
        check_request(body)
        constrained = constraint(body)
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer.chat_template)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        if plan is not None and plan.schema is not None:  # the call is forced by a grammar
            if constrained is not None:
                raise APIError(400, "tool_choice: a forced tool call and an output constraint cannot be combined",
                               param="tool_choice")
            constrained = build_constraint("tools", "json_schema", plan.schema,
                                           grammar_tokenizer(tokenizer, engine.target.cfg.vocab_size, stops))
        in_template = plan is not None and plan.in_template
        turns = []
        for i, m in enumerate(body.messages):
            role = "system" if m.role == "developer" else m.role
            if role not in ("system", "user", "assistant", "tool"):
                raise APIError(400, f"messages.{i}.role: {m.role!r} is not supported (system, developer, user, "
                                    f"assistant, tool)", param=f"messages.{i}.role")
            if m.content is None and role != "assistant":
                raise APIError(400, f"messages.{i}.content: a {m.role} message needs content",
                               param=f"messages.{i}.content")
            if m.content is None or isinstance(m.content, str):
                content = m.content or ""
            else:
                if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in m.content):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported",
                                   param=f"messages.{i}.content")
                content = "\n".join(p["text"] for p in m.content)  # as vLLM joins text parts
            turn = {"role": role, "content": content}
            if m.name is not None:
                turn["name"] = m.name
            if m.tool_calls and role == "assistant":  # the template's own syntax, or this server's JSON as text
                if in_template:
                    turn["tool_calls"] = template_turn_calls(m.tool_calls)
                else:
                    turn["content"] = (content + "\n" if content else "") + calls_as_text(m.tool_calls)
            if m.tool_call_id is not None and role == "tool" and in_template:
                turn["tool_call_id"] = m.tool_call_id
            turns.append(turn)
        kwargs = {}
        if plan is not None:
            turns, kwargs = plan.messages(turns)
        reserved = sorted(set(body.chat_template_kwargs or ()) & _TEMPLATE_ARGUMENTS)
        if reserved:  # what the request's own fields set (tools are refused above), not template options
            raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                           param="chat_template_kwargs")
        try:
            text = tokenizer.apply_chat_template(turns, body.add_generation_prompt,
                                                 **{**(body.chat_template_kwargs or {}), **kwargs})
        except ValueError as e:  # the template refuses the conversation (ChatTemplateError), or has none
            raise APIError(400, f"messages: {e}", param="messages") from None
        # as encode_chat: the template writes any BOS
        return body, encode(text, "messages", add_special=False), constrained, plan

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, ids, constrained = await off_loop(prepare_completion, await read_body(request))
        return await run(request, body, ids, body.max_tokens, chat=False, constrained=constrained)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, ids, constrained, plan = await off_loop(prepare_chat, await read_body(request))
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await run(request, body, ids, limit, chat=True, constrained=constrained,
                         tools=plan if plan is not None and plan.mode != "none" else None)

    return app


class _BodyGuard:
    """ASGI middleware bounding request bodies: at most ``max_bytes`` (a larger Content-Length is answered 413
    before any of the body is read; a body without one is counted as it arrives and refused once past it) and
    ``timeout`` seconds from the request's headers to the body's end (408). Either closes the connection, as does
    any answer sent before the body was read to its end (a 401, a 404), so that no unread body is drained.
    Plain ASGI, so streaming answers and disconnects pass through untouched."""

    def __init__(self, app, max_bytes: int, timeout: float | None):
        self.app, self.max_bytes, self.timeout = app, int(max_bytes), timeout

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes (--max-request-body-bytes)",
                        code="request_too_large", close=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            e = self._too_large()
            await _error_response(e.status, e.message, code=e.code, close=True)(scope, receive, send)
            return
        if b"transfer-encoding" not in headers and length in (None, b"0"):  # no body
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        read, done = 0, False

        async def guarded_receive():
            nonlocal read, done
            if done:
                return await receive()
            try:
                message = await (receive() if deadline is None else
                                 asyncio.wait_for(receive(), max(0.0, deadline - loop.time())))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                    f"(--request-body-timeout)", code="request_timeout", close=True) from None
            if message["type"] != "http.request":
                done = True
                return message
            read += len(message.get("body", b""))
            if read > self.max_bytes:
                raise self._too_large()
            done = not message.get("more_body", False)
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and not done:
                hdrs = list(message.get("headers", []))
                if not any(k.lower() == b"connection" for k, _ in hdrs):
                    message = {**message, "headers": [*hdrs, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, guarded_receive, closing_send)


class _HeaderTimeout:
    """Mixed into uvicorn's HTTP protocol class: a connection whose request headers are not complete
    ``header_timeout`` seconds after it opened, or after the first bytes of a request that follows an answer, is
    closed. uvicorn has no such limit: a client that never finishes its headers holds its connection (and a
    descriptor) forever. Idle connections between requests are closed by uvicorn's keep-alive timeout."""

    header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data):
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc):
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is None or cycle.response_complete

    def _watch_headers(self) -> None:
        if not self._between_requests():
            self._disarm_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def server_config(app, *, header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT,
                  keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE, max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
                  **uvicorn_options) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` with the server's connection limits.

    Args:
      header_timeout: seconds a connection may take to send a request's headers (from its opening, or from the
        request's first bytes after an answer); then it is closed.
      keep_alive: seconds an idle kept-alive connection stays open (uvicorn's ``timeout_keep_alive``).
      max_connections: open connections, or requests in flight, past which a request is answered 503 (uvicorn's
        ``limit_concurrency``; None: no limit).
      **uvicorn_options: passed to `uvicorn.Config` (``host``, ``port``, ``log_level``, ...).
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # noqa: PLC0415  (httptools where installed, else h11)

    protocol = type("HeaderTimedHTTPProtocol", (_HeaderTimeout, AutoHTTPProtocol),
                    {"header_timeout": float(header_timeout)})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive, limit_concurrency=max_connections,
                          **uvicorn_options)


class _KeyCheck:
    """ASGI middleware: every HTTP request but ``/health`` and CORS preflights (``OPTIONS``, which browsers send
    without credentials) needs ``Authorization: Bearer <key>`` (else 401). Plain ASGI (not
    `BaseHTTPMiddleware`) so streaming responses and disconnects pass through untouched."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and scope["method"] != "OPTIONS":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
            if not (hmac.compare_digest(given.strip(), self.expected) and scheme.lower() == b"bearer"):
                response = _error_response(401, "a valid API key is required: Authorization: Bearer <key>",
                                           "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _field_path(loc: Sequence) -> list[str]:
    """A validation error's location as the request's field path: without FastAPI's leading ``body`` and
    pydantic's union-branch tags (``stop.str``, ``prompt.list[int]`` -> ``stop``, ``prompt``)."""
    out = []
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or ("[" in part and part.endswith("]"))):
            break  # a branch of a union: the field is what came before it
        out.append(str(part))
    return out


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _next_event(request: Request, events: asyncio.Queue, worker: EngineWorker, req: GenerationRequest,
                      poll: float = 0.25) -> Event | None:
    """The request's next event; None (after cancelling it) if its client disconnected meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), poll)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                worker.cancel(req)
                return None


class BackgroundServer:
    """Serve ``app`` with uvicorn on a thread (tests, benchmarks): ``with BackgroundServer(app) as url: ...``.

    Binds ``host`` (loopback by default) on ``port`` (0: a free one); ``url`` is ``http://host:port``.
    ``limits``: `server_config`'s (``header_timeout``, ``keep_alive``, ``max_connections``).
    Leaving the block shuts the server down gracefully (in-flight requests finish, the engine drains).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, graceful_seconds: float = 60.0,
                 **limits):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = server_config(app, log_level="warning", timeout_graceful_shutdown=graceful_seconds, **limits)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()
