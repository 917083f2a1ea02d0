"""Chat templates: a conversation rendered to prompt text by the model's own Jinja template (a Hugging
Face tokenizer directory's ``chat_template``, embedded in the model file by ``convert --hf``).

The rendering environment is the one those templates are written for: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, the
``{% generation %} ... {% endgeneration %}`` tag (transformers' assistant-mask marker; it renders
its body), a ``tojson`` filter that keeps non-ASCII text, and the helpers
``raise_exception(message)`` and ``strftime_now(format)``. Variables: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` and ``documents`` (None unless
given, as transformers passes them) and whatever extra keywords the caller passes.
jinja2 is an optional dependency (the ``tokenizer`` extra).

What the template sees is prepared as transformers prepares it: a message's keys whose value is
None are dropped (``content=None`` beside ``tool_calls`` is no content, never the text "None"); a
message's reasoning under any of its names (``reasoning_content``, ``thinking``, ``reasoning``) is
given under ``thinking`` and ``reasoning_content`` too; messages, tools, documents and extra
keywords are rebuilt as plain JSON data (numpy scalars as numbers, dataclasses and pydantic models
as dicts, any other object as the inert text "<TypeName>"); ``namespace()`` refuses attributes
starting with "_". ``continue_final_message`` (True, or the name of the final message's field)
leaves the final message open, as transformers does; transformers' other arguments of
apply_chat_template (``chat_template``, ``sanitize_control_tokens``, ``truncation``, ...) are
refused, not handed to the template.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..errors import InvalidInputError, TokenizerError

#: Keywords the renderer sets itself (a caller's extra keywords may not replace them).
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "unk_token")

#: Arguments of transformers' apply_chat_template that never reach its template and that this
#: renderer does not implement: refused by name, never passed on as template variables.
NOT_TEMPLATE_VARIABLES = ("chat_template", "sanitize_control_tokens", "return_assistant_tokens_mask", "padding",
                          "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs")

#: The names a message's reasoning goes by in transformers' renderer (templates read the first).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def check_messages(messages: Any) -> List[Dict[str, Any]]:
    """A conversation: a non-empty list of mappings, each with a str ``role`` and a ``content`` that
    is a str (or None, for a message that only carries tool calls); other keys pass through."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidInputError(f"messages must be a list of {{'role': ..., 'content': ...}} mappings, got "
                                f"{type(messages).__name__}")
    if not messages:
        raise InvalidInputError("messages is empty: a conversation needs at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidInputError(f"messages[{i}] must be a mapping with 'role' and 'content', got "
                                    f"{type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidInputError(f"messages[{i}]['role'] must be a non-empty str (system, user, assistant, "
                                    f"...), got {m.get('role')!r:.60}")
        if "content" not in m or not (m["content"] is None or isinstance(m["content"], str)):
            raise InvalidInputError(f"messages[{i}]['content'] must be a str (or None), got "
                                    f"{type(m.get('content')).__name__}")
        out.append(dict(m))
    return out


def _environment():
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError("chat templates need jinja2: pip install 'tinyloop[tokenizer]'") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's text with
        it (return_assistant_tokens_mask); rendering, it is its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """namespace() without attributes starting with "_" (as transformers' sandbox)."""

        def __init__(*args, **kwargs):          # Jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store an attribute starting with "
                                                      f"an underscore on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.globals["namespace"] = TemplateNamespace
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, jinja2.exceptions.TemplateError


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, as transformers hands template data over: what a template
    sees holds no method of a caller's object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _template_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages as transformers hands them to a template: keys whose value is None dropped,
    plain data, the reasoning under each of its names."""
    out = []
    for m in messages:
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def check_arguments(messages: Any, add_generation_prompt: Any, extra: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The caller's side of a rendering (InvalidInputError naming the value): add_generation_prompt
    a bool, no extra keyword the renderer sets itself nor one of transformers' arguments it does not
    implement, tools given as JSON schemas, continue_final_message (False, True or a field name)
    not with add_generation_prompt and naming a field of the final message, and `messages` a
    conversation (:func:`check_messages`, whose result this returns)."""
    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r:.40}")
    clash = sorted(set(extra) & set(RESERVED))
    if clash:
        raise InvalidInputError(f"template keyword(s) {clash} are set by the renderer itself")
    foreign = sorted(set(extra) & set(NOT_TEMPLATE_VARIABLES))
    if foreign:
        raise InvalidInputError(f"{foreign} are arguments of transformers' apply_chat_template (never template "
                                f"variables) that this renderer does not implement")
    tools = extra.get("tools")
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise InvalidInputError(f"tools must be a list of JSON schemas (mappings), got {type(tools).__name__}")
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise InvalidInputError(f"tools[{i}] must be a JSON schema (a mapping), got {type(t).__name__}"
                                        + (": pass the function's schema (transformers derives it from the "
                                           "function; this renderer does not)" if callable(t) else ""))
    out = check_messages(messages)
    cont = extra.get("continue_final_message", False)
    if cont is not False:
        if not isinstance(cont, (bool, str)) or cont == "":
            raise InvalidInputError(f"continue_final_message must be True, False or the name of the final "
                                    f"message's field to continue, got {cont!r:.40}")
        if add_generation_prompt:
            raise InvalidInputError("continue_final_message (continue the final message) and add_generation_prompt "
                                    "(start a new one) exclude each other: pass add_generation_prompt=False")
        field = cont if isinstance(cont, str) else "content"
        last = out[-1]
        final = last.get(field) if field not in REASONING_FIELDS else \
            next((last[k] for k in REASONING_FIELDS if last.get(k) is not None), None)
        if not isinstance(final, str):
            raise InvalidInputError(f"continue_final_message: the final message has no text {field!r} to continue")
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, bos_token: str,
           eos_token: str, extra: Mapping[str, Any], special: Optional[Mapping[str, str]] = None) -> str:
    """The prompt text of `messages` under `template` (module docstring), `extra` the caller's
    further template variables, `special` the checkpoint's other special-token texts (pad_token,
    unk_token) when it has them. A template that fails to
    parse or raises (``raise_exception``, a sandbox violation, an undefined call, any exception
    of the rendering itself: a division by zero, an overflow) is a TokenizerError naming the cause."""
    messages = check_arguments(messages, add_generation_prompt, extra)
    extra = dict(extra)
    cont = extra.pop("continue_final_message", False)
    try:
        messages = _template_messages(messages)
        variables = _plain({"tools": None, "documents": None, **extra,   # transformers always sets both
                            **{k: v for k, v in (special or {}).items() if k in ("pad_token", "unk_token")}})
    except RecursionError:
        raise InvalidInputError("messages, tools, documents or a template keyword nest too deeply (or hold "
                                "themselves)") from None
    fields, final = [], None
    if cont:                    # transformers' prefill: tag the final text, render, cut the text at the tag
        field = cont if isinstance(cont, str) else "content"
        final = messages[-1][field]
        fields = [f for f in REASONING_FIELDS if messages[-1].get(f) == final] if field in REASONING_FIELDS \
            else [field]
        if not any(f in template for f in fields):
            raise InvalidInputError(f"continue_final_message: the chat template never reads the final message's "
                                    f"{field!r}")
        for f in fields:
            messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    env, TemplateError = _environment()
    try:
        compiled = env.from_string(template)
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **variables)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:      # anything the template's own code raised (ZeroDivisionError, OverflowError, ...)
        raise TokenizerError(f"the model's chat template failed on these messages: {type(e).__name__}: {e}") from None
    if cont:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TokenizerError("continue_final_message: the chat template does not render the final message's "
                                 "text, so there is no place to continue it")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
