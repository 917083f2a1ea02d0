"""Differential property test of ``convert --hf`` against transformers itself, over the configs a
real user's Llama / Mistral / Qwen2 checkpoint may have: hidden size, heads and kv heads (GQA,
MQA), an explicit head_dim apart from hidden / heads, tying, rope_theta, rms_norm_eps, Llama's
attention_bias / mlp_bias, hidden_act variants, RoPE scaling of every type transformers builds,
max_position_embeddings below the prompt, bos / eos ids (eos lists), float32 / bfloat16 / float16
weights, single-file and sharded checkpoints, transformers 4 and 5 config styles (and keys left
at their defaults), a tied checkpoint that stores lm_head.weight anyway, Mistral's and Qwen2's
sliding windows below the prompt (Qwen2's from max_window_layers on), and config keys
transformers ignores for the class (Mistral's attention_bias / mlp_bias). Each drawn checkpoint
is built by transformers (seeded), written by ``save_pretrained``, converted (the in-process API
or ``python -m tinyloop convert``) at f32 and loaded on the CPU backend; the oracle is what
transformers' ``from_pretrained`` makes of the same directory: fp32 logits within 1e-4 of the
largest, and ``generate(do_sample=False)``'s greedy tokens (uncached, see _greedy_with_margins),
eos stops included. A config the family cannot run exactly must be refused with a TinyLoopError
naming every reason, before any output file is written. A checkpoint storing a block R times
weight-tied, converted with ``--loop-layers A:B --loops R``, equals transformers at L = R.
Needs torch and transformers; tiny shapes, bounded derandomized examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.errors import TinyLoopError  # noqa: E402

from test_hf_import import V, _hf_greedy, _hf_logits, _make, _save  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11, 200, 31]
N_GEN = 8
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: hidden_act values that are SiLU in transformers (exact); every other one is refused
EXACT_ACTS = ("silu", "swish")
#: RoPE scalings built exactly; the others must be refused naming their type
EXACT_ROPE = (None, "default", "linear", "llama3")


# ----------------------------------------------------------------------------------- helpers
def _rope_params(kind, theta, head_dim, orig):
    """A rope_parameters dict transformers builds for `kind` (None: plain RoPE)."""
    p = {"rope_type": kind or "default", "rope_theta": theta}
    if kind == "linear":
        p.update(factor=2.5)
    elif kind == "llama3":
        p.update(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=orig)
    elif kind == "dynamic":
        p.update(factor=2.0)
    elif kind == "yarn":
        p.update(factor=4.0, original_max_position_embeddings=orig)
    elif kind == "longrope":
        p.update(short_factor=[1.0] * (head_dim // 2), long_factor=[2.0] * (head_dim // 2),
                 original_max_position_embeddings=orig)
    return p


def _to_v4_style(src, old_type_key: bool) -> None:
    """Rewrite config.json as transformers 4 wrote it: top-level rope_theta and rope_scaling
    (None for plain RoPE; the scaling's type under "type" in the oldest configs)."""
    p = os.path.join(src, "config.json")
    with open(p) as f:
        d = json.load(f)
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    kind = rp.pop("rope_type", "default")
    d["rope_scaling"] = None if kind == "default" else {("type" if old_type_key else "rope_type"): kind, **rp}
    with open(p, "w") as f:
        json.dump(d, f)


def _reference(src, kind):
    """What transformers makes of the directory, in float32."""
    cls = getattr(transformers, _CLASSES[kind])
    return cls.from_pretrained(src, dtype=torch.float32).eval()


def _greedy_with_margins(m, ids, n):
    """transformers' greedy tokens with its own generation config (eos ids included) and the
    number of leading steps whose top-2 logit gap is clear of fp32 noise (a near-tie there may
    legitimately go either way). Without transformers' KV cache: at sliding_window 1 its cached
    decoding departs from its own forward (which the uncached steps are)."""
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, use_cache=False)
    tokens = out.sequences[0].tolist()
    clear = 0
    for lg in out.logits:
        top = torch.topk(lg[0].double(), 2).values
        if float(top[0] - top[1]) < 1e-3 * float(lg[0].abs().max()):
            break
        clear += 1
    return tokens, clear


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tinyloop", "convert", *args], capture_output=True, text=True)


def _convert(src, out, via_cli, **kw):
    """Convert with the in-process API or the CLI (f32: exact); returns the converter's error
    text ("" on success) and asserts the CLI's exit status matches."""
    if via_cli:
        args = ["--hf", src, "-o", out, "--quant", "f32"]
        if kw.get("loop_layers") is not None:
            args += ["--loop-layers", kw["loop_layers"]]
        for k in ("loops", "max_loops"):
            if kw.get(k) is not None:
                args += ["--" + k.replace("_", "-"), str(kw[k])]
        r = _cli(*args)
        assert "Traceback" not in r.stderr, r.stderr
        assert r.returncode in (0, 2), (r.returncode, r.stderr)
        return "" if r.returncode == 0 else r.stderr
    try:
        convert_hf(src, out, quant="f32", **kw)
    except TinyLoopError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _compare(model, ref, prompt, n_gen, loops=None):
    """Logits and greedy tokens of the converted model against transformers' `ref`."""
    W = model.cfg.sliding_window
    windowed = bool(W) and W < len(prompt) + n_gen
    want_logits = _hf_logits(ref, prompt)
    if windowed:
        got = tl.score_decoded(model, prompt, tl.GenerateConfig(cache_mode="fp32", cache_window=W, loops=loops))
    else:
        got = tl.score(model, prompt, loops=loops, cache_mode="fp32")
    err = np.abs(got - want_logits).max()
    assert err <= 1e-4 * np.abs(want_logits).max(), f"logits differ by {err:.3g} (max {np.abs(want_logits).max():.3g})"
    want, clear = _greedy_with_margins(ref, prompt, n_gen)
    cfg = tl.GenerateConfig(max_tokens=n_gen, cache_mode="fp32", cache_window=W if windowed else 0, loops=loops)
    res = list(tl.generate(model, prompt, cfg))
    k = len(prompt) + clear                  # tokens chosen by clear margins
    assert res[:k] == want[:k], f"greedy tokens differ: {res} vs transformers {want}"
    if clear == n_gen or clear == len(want) - len(prompt):
        assert res == want


# ------------------------------------------------------------------------- the config space
@st.composite
def hf_configs(draw):
    kind = draw(st.sampled_from(["llama", "mistral", "qwen2"]))
    heads, kv = draw(st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2)]))
    per_head = draw(st.sampled_from([4, 6, 8]))
    head_dim = draw(st.sampled_from([None, 4, 8, 12, 16]))
    hidden = heads * per_head                  # Llama requires hidden % heads == 0, even with head_dim
    if kind != "llama" and head_dim is not None and draw(st.booleans()):
        hidden = draw(st.sampled_from([20, 28]))   # Mistral / Qwen2: hidden need not split into heads
    rope = draw(st.sampled_from([None, None, "default", "linear", "llama3", "llama3", "dynamic", "yarn", "longrope"]))
    layers = draw(st.integers(1, 3))
    d = dict(
        kind=kind, heads=heads, kv=kv, hidden=hidden, head_dim=head_dim,
        layers=layers, ff=draw(st.sampled_from([24, 40, 64])),
        tied=draw(st.booleans()),
        # a tied checkpoint that stores lm_head.weight anyway: the embedding's bytes (as .bin
        # conversions do), or other values (transformers 5 then unties, transformers 4 tied)
        head_stored=draw(st.sampled_from([None, None, "same", "differs"])),
        theta=draw(st.sampled_from([10000.0, 500000.0, 1e6, 100.0])),
        eps=draw(st.sampled_from([1e-6, 1e-5, 1e-2])),
        act=draw(st.sampled_from(["silu", "silu", "silu", "swish", "gelu", "gelu_pytorch_tanh"])),
        rope=rope, orig=draw(st.sampled_from([4, 8, 32])),
        # llama3's original_max_position_embeddings: in the scaling (as written), absent from it
        # (transformers 5 reads max_position_embeddings), only at the top level (transformers 5
        # reads it there), or at both with another value (transformers 5 prefers the top level)
        orig_where=draw(st.sampled_from(["rope", "rope", "absent", "top", "both"])) if rope == "llama3" else "rope",
        max_pos=draw(st.sampled_from([8, 256])),
        # Llama's attention_bias / mlp_bias are built by transformers; Mistral and Qwen2 ignore the keys
        attention_bias=draw(st.integers(0, 5)) == 0, mlp_bias=draw(st.integers(0, 5)) == 0,
        bos=draw(st.sampled_from([None, 0, 1])),
        eos=draw(st.sampled_from(["none", "none", "int", "list", "list_missing"])),
        eos_pick=draw(st.lists(st.integers(0, N_GEN - 1), min_size=1, max_size=3)),
        dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])),
        sharded=draw(st.booleans()),
        window=draw(st.sampled_from([None, 1, 3, 5, 12, 64])) if kind != "llama" else None,
        # Qwen2: use_sliding_window from max_window_layers on (0: every layer; >= layers: none)
        max_window_layers=draw(st.integers(0, layers)) if kind == "qwen2" else None,
        v4_style=draw(st.sampled_from([None, "rope_type", "type"])),
        via_cli=draw(st.integers(0, 3)) == 0,
        seed=draw(st.integers(0, 2 ** 16)))
    return d


def _window(d) -> int:
    """The attention window transformers gives every layer of `d` (None when per-layer)."""
    if d["kind"] == "mistral":
        return d["window"] or 0
    if d["kind"] == "qwen2" and d["window"]:
        mwl = d["max_window_layers"]
        return d["window"] if mwl == 0 else 0 if mwl >= d["layers"] else None
    return 0


def expected_refusals(d):
    """(reasons the converter must name, reasons it may name instead of converting exactly);
    both empty: it must convert exactly."""
    must, may = [], []
    if d["act"] not in EXACT_ACTS:
        must.append("hidden_act")
    if d["rope"] not in EXACT_ROPE:
        must.append(d["rope"])
    if d["kind"] == "llama" and d["attention_bias"]:
        must.append("attention_bias")
    if d["kind"] == "llama" and d["mlp_bias"]:
        must.append("mlp_bias")
    if _window(d) is None:
        must.append("per-layer windows")
    if d["tied"] and d["head_stored"] == "differs":
        may.append("lm_head.weight")
    if d["orig_where"] == "both":      # transformers 4 read the scaling's value, 5 the top level's
        may.append("original_max_position_embeddings")
    return must, may


def _edit(src, fn) -> None:
    p = os.path.join(src, "config.json")
    with open(p) as f:
        c = json.load(f)
    fn(c)
    with open(p, "w") as f:
        json.dump(c, f)


def _store_head(src, differs: bool, seed: int) -> None:
    """Add lm_head.weight to a tied checkpoint, beside the embedding (its shard, the index)."""
    from safetensors.torch import load_file, save_file
    index = os.path.join(src, "model.safetensors.index.json")
    shard = "model.safetensors"
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        shard = idx["weight_map"]["model.embed_tokens.weight"]
        idx["weight_map"]["lm_head.weight"] = shard
        with open(index, "w") as f:
            json.dump(idx, f)
    t = load_file(os.path.join(src, shard))
    e = t["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed)
    t["lm_head.weight"] = torch.randn(e.shape, generator=g).to(e.dtype) if differs else e.clone()
    save_file(t, os.path.join(src, shard), metadata={"format": "pt"})


def _build(d, root):
    """The checkpoint directory of config `d` (and transformers' free greedy continuation of the
    prompt, from which eos ids are picked so that they do fire)."""
    hd = d["head_dim"] or d["hidden"] // d["heads"]
    over = dict(hidden_size=d["hidden"], num_attention_heads=d["heads"], num_key_value_heads=d["kv"],
                num_hidden_layers=d["layers"], intermediate_size=d["ff"], tie_word_embeddings=d["tied"],
                rms_norm_eps=d["eps"], hidden_act=d["act"], max_position_embeddings=d["max_pos"],
                rope_parameters=_rope_params(d["rope"], d["theta"], hd, d["orig"]), bos_token_id=d["bos"])
    if d["head_dim"] is not None:
        over["head_dim"] = d["head_dim"]
    if d["kind"] == "llama":
        over.update(attention_bias=d["attention_bias"], mlp_bias=d["mlp_bias"])
    if d["kind"] == "mistral":
        over["sliding_window"] = d["window"]
    m = _make(d["kind"], seed=d["seed"], **over)
    free = _hf_greedy(m, PROMPT, N_GEN)[len(PROMPT):]
    if d["eos"] == "int":
        eos = free[d["eos_pick"][0]]
    elif d["eos"].startswith("list"):
        eos = [free[i] for i in d["eos_pick"]]
        if d["eos"] == "list_missing":        # an end id the model never emits comes first
            eos = [next(t for t in range(V) if t not in free)] + eos
    else:
        eos = None
    m.config.eos_token_id = eos
    m.generation_config.eos_token_id = eos
    m.generation_config.bos_token_id = d["bos"]
    m = m.to(_DTYPES[d["dtype"]])
    src = os.path.join(root, "ckpt")
    _save(m, src, **({"max_shard_size": "2KB"} if d["sharded"] else {}))
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json")) == d["sharded"]

    def edit(c):
        if d["kind"] != "llama":               # keys transformers ignores for these classes
            c.update({k: True for k in ("attention_bias", "mlp_bias") if d[k]})
        if d["kind"] == "qwen2" and d["window"]:
            c.update(use_sliding_window=True, sliding_window=d["window"], max_window_layers=d["max_window_layers"])
            c["layer_types"] = ["sliding_attention" if i >= d["max_window_layers"] else "full_attention"
                                for i in range(d["layers"])]
        rp = c["rope_parameters"]
        if d["orig_where"] in ("absent", "top"):
            del rp["original_max_position_embeddings"]
        if d["orig_where"] in ("top", "both"):
            c["original_max_position_embeddings"] = 2 * d["orig"]
    _edit(src, edit)
    if d["tied"] and d["head_stored"]:
        _store_head(src, d["head_stored"] == "differs", d["seed"])
    if d["v4_style"]:
        _to_v4_style(src, d["v4_style"] == "type")
        if d["v4_style"] == "type":           # old configs: no layer_types, keys at their defaults left out
            def old(c):
                c.pop("layer_types", None)
                for key, field, default in (("head_dim", "head_dim", None), ("tie_word_embeddings", "tied", False),
                                            ("rms_norm_eps", "eps", 1e-6), ("rope_theta", "theta", 10000.0)):
                    if d[field] == default:
                        c.pop(key, None)
            _edit(src, old)
    return src, eos


def _ex(**over) -> dict:
    """An explicit point of the config space: a small untied Llama, changed by `over`."""
    return dict(dict(kind="llama", heads=4, kv=2, hidden=32, head_dim=None, layers=2, ff=40, tied=False,
                     head_stored=None, theta=10000.0, eps=1e-6, act="silu", rope=None, orig=8, orig_where="rope",
                     max_pos=256, attention_bias=False, mlp_bias=False, bos=None, eos="none", eos_pick=[0],
                     dtype="float32", sharded=False, window=None, max_window_layers=None, v4_style=None,
                     via_cli=False, seed=1), **over)


@settings(max_examples=80, **SETTINGS)
@given(d=hf_configs())
# the defects this test found, kept as explicit examples (each failed before its fix):
# transformers' "swish" is SiLU (was refused)
@example(d=_ex(act="swish", kind="qwen2", max_window_layers=0))
# Mistral's layers have no biases whatever attention_bias / mlp_bias say (was refused)
@example(d=_ex(kind="mistral", attention_bias=True, mlp_bias=True, window=5, via_cli=True))
# llama3 RoPE: original_max_position_embeddings at the top level only, or absent (transformers 5
# falls back to it / to max_position_embeddings; was refused), or at both with other values
# (transformers 5 reads the top level's, 4 the scaling's: was converted with the scaling's, silently)
@example(d=_ex(rope="llama3", orig_where="top", v4_style="rope_type"))
@example(d=_ex(rope="llama3", orig_where="absent", max_pos=8))
@example(d=_ex(rope="llama3", orig_where="both", theta=500000.0))
# tie_word_embeddings with a stored lm_head.weight that is another matrix (transformers 5 runs it;
# was converted with the embedding as the head, silently), and one with the embedding's bytes
@example(d=_ex(tied=True, head_stored="differs", sharded=True, dtype="bfloat16"))
@example(d=_ex(tied=True, head_stored="same", kind="qwen2", via_cli=True))
def test_conversion_equals_transformers_or_is_refused_with_every_reason(d):
    must, may = expected_refusals(d)
    note(repr(d))
    event("refused: " + ", ".join(must) if must else f"converted: {d['kind']} act={d['act']} rope={d['rope']}")
    with tempfile.TemporaryDirectory() as root:
        src, eos = _build(d, root)
        outdir = os.path.join(root, "out")
        os.mkdir(outdir)
        out = os.path.join(outdir, "m.tinyloop")
        err = _convert(src, out, d["via_cli"])
        if err:
            assert os.listdir(outdir) == [], "a refused conversion left files behind"
        if must or (err and may):
            assert err, f"converted a checkpoint it must refuse ({must})"
            missing = [w for w in must + (may if not must else []) if w not in err]
            assert not missing, f"the refusal does not name {missing}: {err}"
            return
        assert not err, f"refused a checkpoint transformers runs exactly: {err}"
        ref = _reference(src, d["kind"])
        model = tl.load_model(out, backend="cpu", max_seq_len=64)
        try:
            c = model.cfg
            assert c.tied_embeddings == d["tied"] and c.qkv_bias == (d["kind"] == "qwen2")
            assert c.head_dim == (d["head_dim"] or d["hidden"] // d["heads"])
            assert c.bos_id == d["bos"]
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(dict.fromkeys(eos)))
            assert list(c.eos_ids) == eos_ids
            assert c.sliding_window == _window(d)
            _compare(model, ref, PROMPT, N_GEN)
        finally:
            tl.free_model(model)


# ------------------------------------------------------------------ weight-tied loop blocks
@st.composite
def tied_checkpoints(draw):
    return dict(kind=draw(st.sampled_from(["llama", "mistral", "qwen2"])), pre=draw(st.integers(0, 2)),
                block=draw(st.integers(1, 2)), copies=draw(st.integers(2, 3)), post=draw(st.integers(0, 1)),
                tied=draw(st.booleans()), dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                sharded=draw(st.booleans()), extra_depth=draw(st.integers(0, 2)),
                via_cli=draw(st.integers(0, 2)) == 0, seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=12, **SETTINGS)
@given(d=tied_checkpoints())
def test_weight_tied_loop_block_equals_transformers(d):
    """Layers A .. A + k - 1 stored R times in a row (weight-tied copies), converted with
    --loop-layers A:A+k --loops R: the looped model at L = R is transformers' untied-equivalent
    stack (logits and greedy tokens); with --loop-layers spanning every copy (run once) too."""
    A, k, R = d["pre"], d["block"], d["copies"]
    N = A + k * R + d["post"]
    m = _make(d["kind"], seed=d["seed"], num_hidden_layers=N, hidden_size=32, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=40, tie_word_embeddings=d["tied"],
              **({"sliding_window": 5} if d["kind"] == "mistral" else {}))
    with torch.no_grad():
        for c in range(1, R):
            for j in range(k):
                m.model.layers[A + c * k + j].load_state_dict(m.model.layers[A + j].state_dict())
    m = m.to(_DTYPES[d["dtype"]])
    with tempfile.TemporaryDirectory() as root:
        src = _save(m, os.path.join(root, "tied"), **({"max_shard_size": "2KB"} if d["sharded"] else {}))
        ref = _reference(src, d["kind"])
        B = A + k
        max_loops = R + d["extra_depth"]
        for name, kw, shape in (
                ("loop", dict(loop_layers=f"{A}:{B}", loops=R, max_loops=max_loops), (A, k, d["post"], R)),
                ("span", dict(loop_layers=f"{A}:{A + k * R}"), (A, k * R, d["post"], 1))):
            out = os.path.join(root, f"{name}.tinyloop")
            err = _convert(src, out, d["via_cli"], **kw)
            assert not err, err
            model = tl.load_model(out, backend="cpu", max_seq_len=64)
            try:
                c = model.cfg
                assert (c.n_pre, c.n_loop, c.n_post, c.default_loops) == shape
                _compare(model, ref, PROMPT, N_GEN)
                if name == "loop":
                    assert c.max_loops == max_loops
                    _compare(model, ref, PROMPT, 4, loops=R)
            finally:
                tl.free_model(model)
