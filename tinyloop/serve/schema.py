"""The request and response bodies of the OpenAI-compatible routes (pydantic models; FastAPI builds
the OpenAPI schema from them), and the mapping of a completion request onto a GenerateConfig.

OpenAI fields with their OpenAI meaning (``temperature`` defaults to 1.0, ``max_tokens`` to the
server's max_tokens_default, ``stop`` is text); TinyLoop's knobs are extra body fields (the openai
client's ``extra_body``). OpenAI features TinyLoop does not have (n > 1, best_of > 1, logprobs,
presence / frequency penalties, logit_bias, suffix) are refused with a 400 naming the field,
never ignored. Unknown fields are a 400 too."""

from __future__ import annotations

import secrets
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConfigError
from ..runtime.config import MAX_TOKENS, GenerateConfig

#: OpenAI's limit on stop strings.
MAX_STOPS = 4


class _Strict(BaseModel):
    # allow_inf_nan: Python's JSON reader takes NaN and Infinity, which no field means
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True
    """OpenAI's padding of stream chunks against length side channels: accepted, without effect
    (TinyLoop's chunks carry no obfuscation field either way)."""


class ResponseFormat(_Strict):
    """``{"type": "text"}``; ``{"type": "json_object"}`` (a JSON object); ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}``; TinyLoop's ``{"type": "regex", "regex": ...}``
    and ``{"type": "lark", "lark": ...}``; for the JSON types TinyLoop's ``"whitespace"``:
    flexible (default: any JSON whitespace), compact (none) or spaced (``", "`` and ``": "``)."""

    type: Literal["text", "json_object", "json_schema", "regex", "lark"]
    json_schema: Optional[Dict[str, Any]] = None
    regex: Optional[str] = None
    lark: Optional[str] = None
    whitespace: Optional[Literal["flexible", "compact", "spaced"]] = None


class _Generation(_Strict):
    """The fields completions and chat completions share: OpenAI's, then TinyLoop's own knobs."""

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=0, le=MAX_TOKENS)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)     # OpenAI's range
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = Field(default=None, ge=0, le=2 ** 64 - 1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # TinyLoop's own knobs
    loops: Optional[int] = Field(default=None, ge=1)
    decoder: Optional[str] = None
    options: Optional[Dict[str, Any]] = None
    top_k: Optional[int] = Field(default=None, ge=1)
    repetition_penalty: Optional[float] = None
    cache_mode: Optional[str] = None
    cache_window: Optional[int] = Field(default=None, ge=0)
    beam_size: Optional[int] = Field(default=None, ge=0)
    length_penalty: Optional[float] = None
    early_exit_patience: Optional[int] = Field(default=None, ge=0)
    early_exit_min_L: Optional[int] = Field(default=None, ge=1)
    early_exit_peek_every: Optional[int] = Field(default=None, ge=1)
    early_exit_logit_margin: Optional[float] = Field(default=None, ge=0.0)
    early_exit_criterion: Optional[str] = None
    early_exit_threshold: Optional[float] = Field(default=None, ge=0.0)
    early_exit_kv: Optional[str] = None
    stop_token_ids: Optional[List[List[int]]] = None
    response_format: Optional[ResponseFormat] = None
    timeout: Optional[float] = Field(default=None, gt=0.0)


class CompletionRequest(_Generation):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(_Strict):
    """One message of a conversation (content None: a message that only carries tool calls).
    ``content`` may be a list of text parts (``{"type": "text", "text": ...}``, joined by newlines);
    an assistant reply sent back as the SDK dumps it carries ``refusal``, ``function_call``
    (passed to the template like the rest), ``annotations`` (dropped: citations of the reply)
    and ``audio`` (null only)."""

    role: str = Field(min_length=1)
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    function_call: Optional[Dict[str, Any]] = None
    annotations: Optional[List[Dict[str, Any]]] = None
    audio: Optional[Dict[str, Any]] = None


class ChatCompletionRequest(_Generation):
    """OpenAI chat completions: the conversation is rendered by the model's own chat template
    (tinyloop.apply_chat_template); ``tools`` reach the template."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0, le=MAX_TOKENS)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None


class ChoiceStats(BaseModel):
    """TinyLoop's per-choice statistics (beside OpenAI's fields)."""

    stop_reason: Optional[str] = None
    loops_used: float = 0
    """The request's loop depth, or with early exit the mean depth its tokens ran."""
    token_loops: List[int] = []
    """Early exit: the depth behind each generated token (empty otherwise)."""
    decoder: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    first_token_ms: float = 0.0
    tokens_per_s: float = 0.0


class Choice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    tinyloop: Optional[ChoiceStats] = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[Choice]
    usage: Optional[Usage] = None


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    tinyloop: Optional[ChoiceStats] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tinyloop"
    max_seq_len: int
    max_loops: int
    default_loops: int
    backend: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class FieldError(ConfigError):
    """A request field TinyLoop cannot honour (HTTP 400 naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _unsupported(req: _Generation) -> None:
    chat = isinstance(req, ChatCompletionRequest)
    checks = [("n", req.n not in (None, 1), "n must be 1 (one completion per prompt)"),
              ("best_of", getattr(req, "best_of", None) not in (None, 1), "best_of must be 1 or absent"),
              ("logprobs", req.logprobs not in ((None, False) if chat else (None,)), "logprobs are not supported"),
              ("top_logprobs", getattr(req, "top_logprobs", None) not in (None, 0), "logprobs are not supported"),
              ("tool_choice", getattr(req, "tool_choice", None) not in (None, "none", "auto"),
               "tool_choice must be 'none' or 'auto' (the model's own template decides how tools are offered)"),
              ("max_completion_tokens", chat and None not in (req.max_tokens, getattr(req, "max_completion_tokens", None)),
               "give max_tokens or max_completion_tokens, not both"),
              ("presence_penalty", req.presence_penalty not in (None, 0, 0.0),
               "presence_penalty is not supported (use repetition_penalty)"),
              ("frequency_penalty", req.frequency_penalty not in (None, 0, 0.0),
               "frequency_penalty is not supported (use repetition_penalty)"),
              ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
              ("suffix", getattr(req, "suffix", None) is not None, "suffix (insertion) is not supported")]
    for param, bad, message in checks:
        if bad:
            raise FieldError(param, message)


#: The keys of OpenAI's json_schema wrapper that are not JSON Schema keywords: a json_schema object
#: holding one of them is the wrapper, whose schema is under "schema" (never the wrapper itself).
_WRAPPER_KEYS = ("name", "strict", "schema")


def grammar_of(fmt: Optional[ResponseFormat]) -> Any:
    """The GenerateConfig grammar a response_format asks for (None: unconstrained)."""
    if fmt is None:
        return None
    # each constraint field is read by the type of its own name only: given to another type it would
    # be silently ignored (a 400 instead)
    for other in ("json_schema", "regex", "lark"):
        if getattr(fmt, other) is not None and other != fmt.type:
            raise FieldError("response_format", f"response_format type {fmt.type!r} does not use the {other!r} "
                                                f"field (it would be ignored); use type {other!r} for it")
    if fmt.whitespace is not None and fmt.type not in ("json_object", "json_schema"):
        raise FieldError("response_format", f"response_format whitespace applies to the JSON types "
                                            f"(json_object, json_schema), not {fmt.type!r}")
    ws = {} if fmt.whitespace is None else {"whitespace": fmt.whitespace}
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}, **ws}   # OpenAI's JSON mode: an object, not any JSON value
    if fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        wrapper = isinstance(spec, dict) and any(k in spec for k in _WRAPPER_KEYS)
        schema = spec.get("schema") if wrapper else spec
        if not isinstance(schema, dict) or not schema:
            raise FieldError("response_format", "response_format json_schema needs {'schema': {...}} (a JSON "
                                                "schema object beside 'name' and 'strict')")
        return {"json_schema": schema, **ws}
    value = getattr(fmt, fmt.type)
    if not isinstance(value, str) or not value:
        raise FieldError("response_format", f"response_format type {fmt.type!r} needs a non-empty "
                                            f"{fmt.type!r} field")
    return {fmt.type: value}


def check_text(param: str, text: str) -> str:
    """`text` unless it holds a lone UTF-16 surrogate (JSON can escape one, "\\ud800"; it is no
    character: no tokenizer encodes it and no decoded text contains it): a FieldError naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(param, f"{param} holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
                                f"{exc.start}), which is not a character; send whole characters (a surrogate "
                                f"pair for one beyond U+FFFF)") from None
    return text


def stops_of(req: _Generation) -> List[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise FieldError("stop", f"stop holds {len(stops)} strings; at most {MAX_STOPS}")
    if any(not s for s in stops):
        raise FieldError("stop", "stop strings must be non-empty")
    return [check_text("stop", s) for s in stops]


def generate_config(req: _Generation, max_tokens_default: int, vocab_size: int) -> GenerateConfig:
    """The request as a GenerateConfig (ConfigError naming the field for what it cannot be)."""
    _unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise FieldError("stream_options", "stream_options is only allowed with stream: true")
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    max_tokens = req.max_tokens if req.max_tokens is not None else getattr(req, "max_completion_tokens", None)
    fields: Dict[str, Any] = dict(max_tokens=max_tokens_default if max_tokens is None else max_tokens,
                                  temperature=temperature)
    sampling = temperature > 0.01
    if sampling:
        # OpenAI has no top-k: every token stays a candidate unless the request says otherwise
        fields["top_k"] = req.top_k if req.top_k is not None else vocab_size
        fields["top_p"] = 1.0 if req.top_p is None else float(req.top_p)
        fields["sample_seed"] = req.seed if req.seed is not None else secrets.randbits(63)
    else:
        for name in ("top_k", "seed"):
            if getattr(req, name) is not None:
                raise FieldError(name, f"{name} is a sampling knob; the request is greedy (temperature "
                                       f"{temperature} <= 0.01)")
        if req.top_p not in (None, 1.0):
            raise FieldError("top_p", f"top_p is a sampling knob; the request is greedy (temperature "
                                      f"{temperature} <= 0.01)")
    for name in ("loops", "decoder", "repetition_penalty", "cache_mode", "cache_window", "beam_size",
                 "length_penalty", "early_exit_patience", "early_exit_min_L", "early_exit_peek_every",
                 "early_exit_logit_margin", "early_exit_criterion", "early_exit_threshold", "early_exit_kv"):
        v = getattr(req, name)
        if v is not None:
            fields[name] = v
    if req.options:
        fields["options"] = req.options
    if req.stop_token_ids:
        fields["stop_sequences"] = [tuple(s) for s in req.stop_token_ids]
    grammar = grammar_of(req.response_format)
    if grammar is not None:
        fields["grammar"] = grammar
    return GenerateConfig(**fields)
