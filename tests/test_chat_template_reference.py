"""Chat templates against transformers' own renderer: a tiny Llama checkpoint (config.json, numpy
safetensors) with a locally trained byte-level BPE ``tokenizer.json`` and a ``tokenizer_config.json``
carrying bos/eos tokens and a chat template written here, converted with ``convert --hf`` as a
user would; ``tinyloop.apply_chat_template`` must give the text and the token ids that
``PreTrainedTokenizerFast.apply_chat_template`` gives for the same directory (tokenize=False /
True), with the template's one BOS and no second one, and a template's failures are TinyLoop errors
carrying the template's message, never raw jinja2 exceptions.

What real templates use is exercised: namespace() and loop variables, raise_exception on bad role
order, add_generation_prompt, bos/eos tokens, tojson of tools and non-ASCII text, tools and
documents, strftime_now (frozen), {% generation %}, whitespace control, content None + tool_calls,
extra keywords, continue_final_message."""

from __future__ import annotations

import dataclasses
import json
import os
import types

import numpy as np
import pytest

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.errors import TinyLoopError  # noqa: E402

SPECIAL = ["<s>", "</s>", "<|eot|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<pad>", "<unk>"]
CORPUS = ["the loop runs again and again, then it exits early", "weather in Paris — ça va? 東京 tool call",
          "system user assistant get_weather city sunny"] * 10
V = 416             # the checkpoint's vocab_size (the trained tokenizer has fewer ids)


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _write_checkpoint(d, tok, template, *, bos="<s>", eos="</s>", cfg_bos="<s>", cfg_eos="</s>", jinja_file=False):
    """A save_pretrained-shaped Llama directory: config.json (bos/eos ids `cfg_bos` / `cfg_eos`, a
    token or a list of tokens), model.safetensors, tokenizer.json and tokenizer_config.json
    (`bos` / `eos` tokens, the chat template, or chat_template.jinja beside it)."""
    os.makedirs(d)
    H, I, L = 32, 48, 2
    ids = (lambda t: None if t is None else tok.token_to_id(t) if isinstance(t, str) else [tok.token_to_id(x) for x in t])
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H,
               intermediate_size=I, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=ids(cfg_bos), eos_token_id=ids(cfg_eos), hidden_act="silu", torch_dtype="float32")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    rng = np.random.default_rng(0)
    w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)   # noqa: E731
    t = {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H), "model.norm.weight": np.ones(H, np.float32)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(H, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(H, np.float32),
                  p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(H // 2, H),
                  p + "self_attn.v_proj.weight": w(H // 2, H), p + "self_attn.o_proj.weight": w(H, H),
                  p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                  p + "mlp.down_proj.weight": w(H, I)})
    safetensors_numpy.save_file(t, os.path.join(d, "model.safetensors"))
    tok.save(os.path.join(d, "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": "<pad>",
          "unk_token": "<unk>", "model_max_length": 4096}
    if jinja_file:
        with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(template)
    else:
        tc["chat_template"] = template
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, ensure_ascii=False)


@pytest.fixture(scope="module")
def pair(bpe, tmp_path_factory):
    """pair(template, **checkpoint options) -> (TinyLoop model converted from the directory,
    transformers' tokenizer of the same directory); one conversion per distinct argument set."""
    root = tmp_path_factory.mktemp("chat")
    made, models = {}, []

    def get(template, **kw):
        key = json.dumps([template, sorted(kw.items())])
        if key not in made:
            d = str(root / f"ck{len(made)}")
            _write_checkpoint(d, bpe, template, **kw)
            out = d + ".tinyloop"
            convert_hf(d, out, quant="f32")
            model = tl.load_model(out, backend="cpu", max_seq_len=256)
            models.append(model)
            made[key] = (model, transformers.PreTrainedTokenizerFast.from_pretrained(d))
        return made[key]

    yield get
    for m in models:
        tl.free_model(m)


def _hf(hf_tok, convo, tokenize, **kw):
    out = hf_tok.apply_chat_template(convo, tokenize=tokenize, **{"add_generation_prompt": True, **kw})
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


def _check_equal(model, hf_tok, convo, **kw):
    """Text and ids equal transformers'; the ids hold the template's BOS once, first."""
    want_text, want_ids = _hf(hf_tok, convo, False, **kw), _hf(hf_tok, convo, True, **kw)
    kw.setdefault("add_generation_prompt", True)
    got_text = tl.apply_chat_template(model, convo, tokenize=False, **kw)
    assert got_text == want_text
    got_ids = tl.apply_chat_template(model, convo, **kw)
    assert got_ids == want_ids
    bos = model.cfg.bos_id
    if got_text.startswith(model.tokenizer.token_text(bos)):
        assert got_ids[0] == bos and got_ids.count(bos) == 1
    return got_text


# ------------------------------------------------------------------------------ templates
CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris — ça va? 東京"},
         {"role": "assistant", "content": "  again  "}, {"role": "user", "content": "then?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "météo — 東京 \"quoted\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVO = CONVO[:2] + [
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
DOCS = [{"title": "Tōkyō", "text": "東京 is sunny"}, {"title": "B", "text": "b"}]

# system handling through namespace(), loop.first/last/index0, raise_exception on role order, tools
# through tojson, content None + tool_calls, {% generation %}, `-` modifiers
AGENT = """{{- bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% set msgs = messages[1:] %}
{%- else %}{% set msgs = messages %}{% endif %}
{%- if tools is not none %}<|system|>{{ ns.system }}
Tools: {{ tools | tojson }}{{ eos_token }}
{%- elif ns.system %}<|system|>{{ ns.system }}{{ eos_token }}
{%- endif %}
{%- for m in msgs %}
  {%- if m.role != 'tool' and (m.role == 'user') != (loop.index0 % 2 == 0) %}
    {{- raise_exception('roles must alternate user/assistant; got ' ~ m.role ~ ' at ' ~ loop.index0) }}
  {%- endif %}
  {%- if m.role == 'assistant' %}{% set ns.turns = ns.turns + 1 %}<|assistant|>
    {%- generation %}
    {%- if m.content is defined and m.content is not none %}{{ m.content | trim }}{% endif %}
    {%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function | tojson }}</call>{% endfor %}{% endif %}
    {{- eos_token }}{% endgeneration %}
  {%- elif m.role == 'tool' %}<|tool|>{{ m.content }}{{ eos_token }}
  {%- else %}<|user|>{{ m.content }}{% if loop.last %} (turn {{ ns.turns }}){% endif %}{{ eos_token }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

# trim_blocks / lstrip_blocks on tags that stand on their own lines, and text around them
WHITESPACE = ("{{ bos_token }}\n   {% for m in messages %}\n    {{- m.content -}}   \n  {% if loop.last %}\n  LAST\n"
              "{% endif %}\n{% endfor %}\n  tail  \n{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}\n")

# documents, extra keywords (with a default), strftime_now, loop controls
RAG = ("{{ bos_token }}{% if documents is not none %}{% for d in documents %}<doc {{ loop.index }}>{{ d.title }}: "
       "{{ d.text }}</doc>\n{% endfor %}{% endif %}Today: {{ strftime_now('%d %b %Y') }}; "
       "{{ date_string | default('no date') }}; think={{ enable_thinking | default(true) }}\n"
       "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% if loop.index0 > 2 %}{% break %}"
       "{% endif %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}"
       "<|assistant|>{% endif %}")


@pytest.mark.parametrize("convo, kw", [
    (CONVO, {}), (CONVO, {"add_generation_prompt": False}), (CONVO, {"tools": TOOLS}),
    (TOOL_CONVO, {"tools": TOOLS}), (CONVO[1:], {}),
], ids=["plain", "no-generation-prompt", "tools", "tool-calls", "no-system"])
def test_agent_template_equals_transformers(pair, convo, kw):
    model, hf_tok = pair(AGENT)
    text = _check_equal(model, hf_tok, convo, **kw)
    assert text.count("<s>") == 1 and ("東京" in text) and ("\\u" not in text)


@pytest.mark.parametrize("jinja_file", [False, True])
def test_whitespace_control_equals_transformers(pair, jinja_file):
    model, hf_tok = pair(WHITESPACE, jinja_file=jinja_file)
    for agp in (True, False):
        _check_equal(model, hf_tok, CONVO, add_generation_prompt=agp)


def test_documents_extra_keywords_and_frozen_strftime(pair, monkeypatch):
    import datetime as dt
    import tinyloop.model.chat as chat
    import transformers.utils.chat_template_utils as ctu

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 7, 26, 12, 0, 0)

    monkeypatch.setattr(ctu, "datetime", Frozen)
    monkeypatch.setattr(chat, "datetime", types.SimpleNamespace(datetime=Frozen))
    model, hf_tok = pair(RAG)
    text = _check_equal(model, hf_tok, CONVO, documents=DOCS, date_string="26 Jul 2024", enable_thinking=False)
    assert "Today: 26 Jul 2024; 26 Jul 2024; think=False" in text and "<doc 2>B: b</doc>" in text
    assert "no date; think=True" in _check_equal(model, hf_tok, CONVO)


def test_control_token_text_in_content_tokenizes_as_transformers(pair):
    """Text that spells a special token inside a message is matched as that token on both sides
    (transformers' default, sanitize_control_tokens=False)."""
    model, hf_tok = pair(AGENT)
    ids = tl.apply_chat_template(model, [{"role": "user", "content": "hi</s><s>x"}])
    assert ids == _hf(hf_tok, [{"role": "user", "content": "hi</s><s>x"}], True)


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("template, match", [
    (AGENT, "roles must alternate user/assistant; got assistant at 0"),
    ("{{ foo.bar }}", "'foo' is undefined"),
    ("{% for m in messages %}{{ m.content }}{% endfor", "unexpected end of template"),
    ("{{ messages[0].__class__.__mro__ }}", "__class__"),
    ("{{ bos_token.__class__.__mro__[1].__subclasses__() }}", "__class__"),
    ("{{ messages.append(1) }}", "append"),
    ("{{ raise_exception(5) }}", "5"),
    ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "underscore"),
])
def test_template_failures_are_tinyloop_errors(pair, template, match):
    """What transformers raises from the template (TemplateError, UndefinedError, SecurityError,
    TemplateSyntaxError) is a TinyLoopError carrying the template's own message; a namespace
    attribute starting with '_' is refused as transformers' sandbox refuses it."""
    model, hf_tok = pair(template)
    bad = [CONVO[2], CONVO[1]] if template is AGENT else CONVO
    with pytest.raises(Exception, match=match):
        _hf(hf_tok, bad, False)
    with pytest.raises(TinyLoopError, match=match) as e:
        tl.apply_chat_template(model, bad)
    assert not type(e.value).__module__.startswith("jinja2")


def test_a_template_that_is_not_text_is_a_tinyloop_error(tmp_path):
    from tinyloop.model.tokenizer import read_chat_template, tokenizer_from_embedded
    for bad in (5, ["x"], {"template": "x"}, [{"name": "default", "template": 7}]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": bad}))
        with pytest.raises(TinyLoopError):
            read_chat_template(str(tmp_path))
    with pytest.raises(TinyLoopError, match="chat_template"):
        tokenizer_from_embedded({"type": "bpe", "vocab": {"a": 0}, "merges": [], "chat_template": 5})


# ------------------------------------------------------------------------------ defects found
MESSAGE_KEYS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is none %}[none]{% elif m.content is defined %}"
                "{{ m.content }}{% else %}[no content]{% endif %}{% if 'tool_calls' in m %}[calls: {{ m.tool_calls | "
                "length }}]{% endif %}|{% endfor %}")


def test_none_valued_message_keys_are_dropped_as_transformers_drops_them(pair):
    """transformers drops a message's keys whose value is None before rendering (OpenAI clients
    send content=None with tool_calls, tool_calls=None without): `content is defined` is false and
    nothing renders as the text "None". TinyLoop passed the None on: "None" in the prompt, and
    `'tool_calls' in m` true for tool_calls=None (a template iterating it fails)."""
    model, hf_tok = pair(MESSAGE_KEYS)
    convo = TOOL_CONVO + [{"role": "user", "content": "ok", "tool_calls": None, "name": None}]
    text = _check_equal(model, hf_tok, convo)
    assert "[no content][calls: 1]" in text and "None" not in text and "[none]" not in text
    model2, hf2 = pair("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert "None" not in _check_equal(model2, hf2, TOOL_CONVO)
    assert TOOL_CONVO[2]["content"] is None          # the caller's messages are not edited


def test_continue_final_message_leaves_the_last_message_open(pair):
    """continue_final_message (prefill: the model continues the last message) is one of
    transformers' arguments, not a template variable; TinyLoop passed it to the template, which
    ignored it and closed the message with its EOS."""
    model, hf_tok = pair(AGENT)
    prefill = CONVO + [{"role": "assistant", "content": "Sure, the"}]
    text = _check_equal(model, hf_tok, prefill, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|assistant|>Sure, the")
    with pytest.raises(tl.InvalidInputError, match="add_generation_prompt"):
        tl.apply_chat_template(model, prefill, continue_final_message=True)       # default add_generation_prompt=True
    with pytest.raises(tl.InvalidInputError, match="continue_final_message"):
        tl.apply_chat_template(model, prefill, add_generation_prompt=False, continue_final_message="reasoning")


@pytest.mark.parametrize("kw", [{"chat_template": "{{ messages }}"}, {"sanitize_control_tokens": True},
                                {"return_assistant_tokens_mask": True}, {"truncation": True, "max_length": 4},
                                {"return_tensors": "np"}, {"tokenizer_kwargs": {}}])
def test_transformers_only_arguments_are_refused_not_passed_to_the_template(pair, kw):
    """transformers consumes these arguments (they never reach a template); TinyLoop handed them
    to the template as variables, so they were silently without effect."""
    model, _ = pair(AGENT)
    with pytest.raises(tl.InvalidInputError, match=next(iter(kw))):
        tl.apply_chat_template(model, CONVO, **kw)


def test_reasoning_fields_are_aliased_as_transformers_aliases_them(pair):
    """A message's reasoning under any of its names (reasoning_content, thinking, reasoning) reaches
    a template reading reasoning_content or thinking, as transformers passes it."""
    model, hf_tok = pair("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
                         "{% endif %}{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}|{% endfor %}")
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "hmm"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "thinking": "ok"}]
    assert _check_equal(model, hf_tok, convo) == "q|<think>hmm</think>[hmm]a|q2|<think>ok</think>[ok]b|"


@dataclasses.dataclass
class _Doc:
    title: str
    text: str


def test_template_data_is_plain_json_data(pair):
    """tools / documents / extra keywords reach the template as plain JSON data, as transformers
    passes them: numpy scalars as numbers (tojson failed on them), dataclasses as dicts, other
    objects as an inert "<TypeName>" (no method of a caller's object, such as an array's tofile, is
    callable from the template); a tool given as a Python function (transformers derives its JSON schema) is an
    InvalidInputError naming it."""
    model, hf_tok = pair("{{ tools | tojson }}|{{ documents | tojson }}|{{ extra | tojson }}|{{ arr }}")
    tools = [{"type": "function", "function": {"name": "f", "n": np.int64(3), "x": np.float32(0.5), "ok": np.bool_(False)}}]
    text = _check_equal(model, hf_tok, CONVO, tools=tools, documents=[{"title": np.str_("t"), "n": np.int8(1)}],
                        extra={"k": (1, np.int32(2)), "doc": _Doc("t", "東京")}, arr=np.zeros(2))
    assert '"n": 3, "x": 0.5, "ok": false' in text and text.endswith('"doc": {"title": "t", "text": "東京"}}|<ndarray>')

    def get_weather(city: str):
        """Get the weather.

        Args:
            city: the city
        """
    with pytest.raises(tl.InvalidInputError, match="tools"):
        tl.apply_chat_template(model, CONVO, tools=[get_weather])


# ------------------------------------------------------------------------------ left for elsewhere
def test_special_token_variables_come_from_tokenizer_config(pair):
    """bos_token / eos_token / pad_token / unk_token are tokenizer_config.json's texts (embedded by
    convert as the tokenizer's special_tokens), not the texts of config.json's first ids."""
    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ messages | length }}"
    model, hf_tok = pair(template, eos="<|eot|>", cfg_eos=["</s>", "<|eot|>"])   # Llama 3 Instruct's layout
    _check_equal(model, hf_tok, CONVO)


@pytest.mark.xfail(strict=False, reason="read_chat_template keeps only the 'default' of a list of named templates; "
                   "transformers renders 'tool_use' when tools are given (needs the embedded form to carry it)")
def test_named_tool_use_template_is_used_with_tools(pair):
    model, hf_tok = pair([{"name": "default", "template": "D{{ messages | length }}"},
                          {"name": "tool_use", "template": "T{{ tools | length }}"}])
    assert _check_equal(model, hf_tok, CONVO) == "D4"
    _check_equal(model, hf_tok, CONVO, tools=TOOLS)


def test_rendered_chat_text_as_a_str_prompt_has_one_bos(pair):
    """A str prompt gets the model's BOS id before its text unless the text begins with the BOS
    token itself, as a chat rendered with tokenize=False does: one BOS, not two."""
    model, _ = pair(AGENT)
    text = tl.apply_chat_template(model, CONVO, tokenize=False)
    out = tl.generate(model, text, tl.GenerateConfig(max_tokens=1))
    assert list(out[:2]).count(model.cfg.bos_id) == 1
