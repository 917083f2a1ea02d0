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
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Mapping, Sequence

from ..errors import InvalidInputError, TokenizerError

#: Keywords the renderer sets itself (a caller's extra keywords may not replace them).
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, jinja2.exceptions.TemplateError


def check_arguments(messages: Any, add_generation_prompt: Any, extra: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The caller's side of a rendering (InvalidInputError naming the value): add_generation_prompt
    a bool, no extra keyword the renderer sets itself, and `messages` a conversation
    (:func:`check_messages`, whose result this returns)."""
    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r:.40}")
    clash = sorted(set(extra) & set(RESERVED))
    if clash:
        raise InvalidInputError(f"template keyword(s) {clash} are set by the renderer itself")
    return check_messages(messages)


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, bos_token: str,
           eos_token: str, extra: Mapping[str, Any]) -> str:
    """The prompt text of `messages` under `template` (module docstring), `extra` the caller's
    further template variables. A template that fails to
    parse or raises (``raise_exception``, a sandbox violation, an undefined call, any exception
    of the rendering itself: a division by zero, an overflow) is a TokenizerError naming the cause."""
    messages = check_arguments(messages, add_generation_prompt, extra)
    env, TemplateError = _environment()
    try:
        compiled = env.from_string(template)
        variables = {"tools": None, "documents": None, **dict(extra)}   # transformers always sets both
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **variables)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:      # anything the template's own code raised (ZeroDivisionError, OverflowError, ...)
        raise TokenizerError(f"the model's chat template failed on these messages: {type(e).__name__}: {e}") from None
