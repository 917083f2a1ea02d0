"""Edges of the text-level API a demanding user meets: chat templates rendered as transformers'
apply_chat_template renders them (the variables it always sets, its ``{% generation %}`` tag),
and `tinyloop run` prompt files (one prompt per line means per "\\n", a JSONL "prompt" must be a
string)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.main import main  # noqa: E402
from tinyloop.cli.run import read_prompts  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.model.chat import render  # noqa: E402
from tinyloop.runtime.config import RunConfig  # noqa: E402

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi — ça va?"},
         {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}]

# a template written the way tool-calling templates are: `tools is not none`, `documents is not none`;
# transformers renders it for a plain conversation with no tool block
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools is not none %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if documents is not none %}<docs>{{ documents | length }}</docs>\n{% endif %}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

GEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}\n{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

WANT_PLAIN = ("<s><|system|>Be brief.</s>\n<|user|>hi — ça va?</s>\n<|assistant|>yes</s>\n"
              "<|user|>and?</s>\n<|assistant|>")


def _transformers_render(template, convo, **kw):
    tr = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = tr.render_jinja_template(conversations=[convo], chat_template=template,
                                           add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **kw)
    return rendered[0]


def test_chat_template_tools_and_documents_default_to_none():
    """transformers always passes tools=None and documents=None: `tools is not none` is false for a
    conversation without tools (an undefined variable would make it true)."""
    got = render(TEMPLATE, CONVO, True, "<s>", "</s>", {})
    assert got == WANT_PLAIN
    tools = [{"name": "exit", "description": "ends the loop"}]
    with_tools = render(TEMPLATE, CONVO, True, "<s>", "</s>", {"tools": tools})
    assert with_tools.startswith('<s><tools>[{"name": "exit", "description": "ends the loop"}]</tools>\n')
    try:
        want = _transformers_render(TEMPLATE, CONVO)
        want_tools = _transformers_render(TEMPLATE, CONVO, tools=tools)
    except pytest.skip.Exception:
        return
    assert got == want and with_tools == want_tools


def test_chat_template_generation_tag_renders_its_body():
    """{% generation %} ... {% endgeneration %} (transformers' assistant-mask tag) renders its body;
    it is not a template syntax error."""
    got = render(GEN_TEMPLATE, CONVO, False, "<s>", "</s>", {})
    assert got == WANT_PLAIN[:-len("<|assistant|>")]
    try:
        want = _transformers_render(GEN_TEMPLATE, CONVO)
    except pytest.skip.Exception:
        return
    assert render(GEN_TEMPLATE, CONVO, True, "<s>", "</s>", {}) == want == WANT_PLAIN


# --------------------------------------------------------------------------- run: prompt files
def _cfg(**kw):
    return RunConfig(**kw)


def test_prompt_file_lines_split_only_at_newlines(tmp_path):
    """Python source has form feeds (the standard library's files do) and text has U+2028 / NEL:
    they are characters of a prompt, not line ends; JSONL written by json.dumps(ensure_ascii=False)
    keeps U+2028 raw inside its strings."""
    txt = tmp_path / "p.txt"
    txt.write_text("def a():\x0c    pass\r\nx = 1\u2028y = 2\n", encoding="utf-8", newline="")
    assert read_prompts(_cfg(prompts_file=str(txt)), tmp_path) == ["def a():\x0c    pass", "x = 1\u2028y = 2"]
    jl = tmp_path / "p.jsonl"
    prompts = ["s = 'a\u2028b'", "t = '\x85'", "plain"]
    jl.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    assert read_prompts(_cfg(prompts_file=str(jl)), tmp_path) == prompts


@pytest.mark.parametrize("value", [None, 5, ["a"], {"text": "a"}, True])
def test_jsonl_prompt_must_be_a_string(tmp_path, value):
    """{"prompt": null} is not the prompt "None": a ConfigError naming the line and the value."""
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": value}) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"p\.jsonl:2") as e:
        read_prompts(_cfg(prompts_file=str(jl)), tmp_path)
    assert repr(value)[:10] in str(e.value) or json.dumps(value)[:10] in str(e.value)


def test_cli_jsonl_null_prompt_is_an_error_not_a_completion(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt": null}\n', encoding="utf-8")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('model: ""\nbackend: cpu\nmax_seq_len: 32\nprompts_file: p.jsonl\noutput_jsonl: out.jsonl\n'
                   'generate: {max_tokens: 2}\n', encoding="utf-8")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "p.jsonl:1" in err[-1]
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------ GPT-2 style directories
def test_vocab_merges_directory_keeps_its_chat_template(tmp_path):
    """A vocab.json + merges.txt directory's tokenizer_config.json chat template is read as a
    tokenizer.json directory's is, rendered by apply_chat_template, and embedded in a model
    file written with that tokenizer (the 'bpe' embedded form carries it)."""
    pytest.importorskip("jinja2")
    tokenizers = pytest.importorskip("tokenizers")
    from tinyloop.model.format import open_model, write_model
    from tinyloop.model.tokenizer import BPETokenizer, load_tokenizer_dir, tokenizer_from_embedded
    from conftest import TINY, random_weights
    from tinyloop.model.arch import ModelConfig

    lib = tokenizers.ByteLevelBPETokenizer()
    lib.train_from_iterator(["user says hello and assistant answers"] * 20, vocab_size=300,
                            special_tokens=["<|end|>"])
    d = tmp_path / "gpt2"
    d.mkdir()
    lib.save_model(str(d))
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    tok = load_tokenizer_dir(str(d))
    assert isinstance(tok, BPETokenizer) and tok.chat_template == template
    emb = tok.to_embedded()
    assert emb["chat_template"] == template
    assert tokenizer_from_embedded(emb).chat_template == template
    cfg = ModelConfig(**{**TINY, "vocab_size": max(TINY["vocab_size"], tok.vocab_size)})
    path = tmp_path / "m.tinyloop"
    write_model(str(path), cfg, random_weights(cfg, 0), tokenizer=emb)
    with open_model(str(path)) as mf:
        assert mf.header.tokenizer["chat_template"] == template
    m = tl.load_model(str(path), backend="cpu", max_seq_len=64)
    try:
        convo = [{"role": "user", "content": "hello"}]
        got = tl.apply_chat_template(m, convo, add_generation_prompt=True, tokenize=False)
        assert got == "<user>hello<|end|><assistant>"
    finally:
        tl.free_model(m)
