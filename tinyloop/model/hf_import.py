"""Hugging Face checkpoint import: a model directory (``config.json``, safetensors shards,
``tokenizer.json``) of a Llama-family architecture mapped onto the model family.

Supported ``architectures`` (config.json): LlamaForCausalLM (a ``sliding_window`` key is ignored,
as transformers does), MistralForCausalLM (its sliding window becomes ModelConfig.sliding_window)
and Qwen2ForCausalLM (q/k/v biases: qkv_bias; with ``use_sliding_window`` the window applies to
layers from ``max_window_layers`` on, so only "none" or "all" layers can be built), planned
here, and the looped layouts RavenForCausalLM (Huginn-0125) and OuroForCausalLM, planned in
tinyloop.model.hf_looped. The Llama-family checkpoints keep RoPE in the half-split
("rotate_half") layout the kernels use, so no rows are permuted. Every layer is a pre-norm SwiGLU block with an RMSNorm; both config styles are read
(``rope_theta`` / ``rope_scaling`` at the top, or transformers 5's ``rope_parameters``).

Layers become the family's parts:

* by default layers 0 .. N-2 are pre blocks and layer N-1 is a one-layer loop run once
  (``default_loops = max_loops = 1``): the same computation as the original stack;
* ``loop_layers=(A, B)`` makes layers A .. B-1 the shared loop block, ``loops=R`` says the
  checkpoint stores it R times in a row (layers A .. A + R (B - A) - 1, weight-tied: each copy is
  checked to be bit-identical to the first), and the layers after the copies are post blocks;
  ``max_loops`` (default R) is the deepest a request may go.

:func:`plan_hf` checks everything from config.json and the tensor headers before any data is read
and raises ModelFormatError listing every reason a checkpoint does not fit (an unknown
architecture, rope scaling, MoE, biases where the family has none, per-layer windows, missing or
unexpected tensors, ...). The result maps every logical tensor name to its checkpoint name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from ..errors import ConfigError, ModelFormatError
from .arch import ModelConfig, block_tensors, required_tensors

#: architectures (config.json "architectures"[0]) this importer maps; the looped layouts
#: (Huginn-0125's raven, Ouro) are planned in tinyloop.model.hf_looped
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "RavenForCausalLM",
                 "OuroForCausalLM")

_LAYER = "model.layers.{i}."
_BLOCK_MAP = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
              "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
              "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
              "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
              "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
              "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
#: checkpoint tensors that carry no weights of the model (old RoPE caches) and are skipped
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
#: config keys whose presence (with a truthy value) means a mixture of experts
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass
class HFPlan:
    """What :func:`plan_hf` resolved: the model config, logical name -> checkpoint tensor name,
    the copies of the loop block to check against its first copy, and notes for the summary."""

    config: ModelConfig
    names: Dict[str, str]
    architecture: str
    tied_copies: List[Tuple[str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    derived: Dict[str, tuple] = field(default_factory=dict)
    """Logical tensors computed from a checkpoint tensor (a row or column slice, a permutation,
    zeros): logical name -> (checkpoint name or None, function of its float32 array)."""


def read_json(path: str, what: str, error=ModelFormatError) -> dict:
    """A JSON object from `path` (`what` names it in errors, raised as `error`)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise error(f"cannot read {what} {path!r}: {e}") from None
    except (ValueError, RecursionError) as e:   # (JSONDecodeError, UnicodeDecodeError, int digits)
        raise error(f"{what} {path!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} {path!r} is not a JSON object")
    return d


def read_hf_config(model_dir: str) -> dict:
    """config.json of a Hugging Face model directory (ModelFormatError when absent or invalid)."""
    if not os.path.isdir(model_dir):
        raise ModelFormatError(f"--hf {model_dir!r} is not a directory")
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(path) and not os.path.isfile(path):   # a FIFO would block the open
        raise ModelFormatError(f"config {path!r} is not a regular file")
    return read_json(path, "config")


def _token_id(v, name: str, problems: List[str], notes: List[str], key: str) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, list):
        if not v:
            return None
        if len(v) > 1:
            notes.append(f"{name} lists {v}: the first, {v[0]}, is the model's {key}_id"
                         + (", the others extra_eos_ids" if key == "eos" else ""))
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        problems.append(f"{name}={v!r} is not a token id")
        return None
    return v


#: The rope_type of a scaling -> (ModelConfig.rope_scaling, {HF key: ModelConfig field}, required keys).
ROPE_TYPES = {
    "linear": ("linear", {"factor": "rope_factor"}, ("factor",)),
    "llama3": ("llama3", {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                          "high_freq_factor": "rope_high_freq_factor",
                          "original_max_position_embeddings": "rope_original_max_positions"},
               ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
}


def _rope_fields(c: dict, problems: List[str]) -> dict:
    """rope_theta and the RoPE frequency scaling (ModelConfig.rope_scaling and its parameters) from
    ``rope_theta`` / ``rope_scaling`` at the top, or transformers 5's ``rope_parameters``. Plain,
    linear and llama3 (Llama 3.1 / 3.2) RoPE are built; YaRN, dynamic and long-rope are refused."""
    rp = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    theta = c.get("rope_theta")
    for key, v in (("rope_parameters", rp), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            problems.append(f"{key}={v!r} must be null or an object")
    out = {}
    for key, v in (("rope_parameters", rp), ("rope_scaling", scaling)):
        if not isinstance(v, dict):
            continue
        if key == "rope_parameters":
            theta = v.get("rope_theta", theta)
        kind = v.get("rope_type", v.get("type", "default"))
        if kind in ("default", None):
            continue
        if not isinstance(kind, str) or kind not in ROPE_TYPES:
            problems.append(f"{key}.rope_type={kind!r}: only plain, linear and llama3 RoPE are built (no "
                            f"YaRN / dynamic / long-rope scaling)")
            continue
        name, fields, required = ROPE_TYPES[kind]
        top = c.get("original_max_position_embeddings")
        if kind == "llama3" and v.get("original_max_position_embeddings") is None:
            # as transformers 5: the top-level key, else max_position_embeddings
            v = dict(v, original_max_position_embeddings=top if top is not None
                     else c.get("max_position_embeddings"))
        elif kind == "llama3" and top is not None and top != v["original_max_position_embeddings"]:
            problems.append(f"original_max_position_embeddings={top!r} at the top level and "
                            f"{v['original_max_position_embeddings']!r} in {key} disagree (transformers 5 "
                            f"reads the top level's, transformers 4 the scaling's)")
            continue
        missing = [k for k in required if v.get(k) is None]
        if missing:
            problems.append(f"{key} of rope_type {kind!r} lacks {missing}")
            continue
        extra = {k: v[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if v.get(k) not in (None, 1, 1.0)}
        if extra:
            problems.append(f"{key} sets {extra}: attention scaling of RoPE is not built")
        found = dict(rope_scaling=name, **{field: v[k] for k, field in fields.items()})
        if out and out != found:
            problems.append(f"rope_scaling and rope_parameters disagree ({out} against {found})")
        out = found
    if c.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        problems.append(f"partial_rotary_factor={c['partial_rotary_factor']!r}: RoPE must rotate "
                        f"whole heads")
    out["rope_theta"] = 10000.0 if theta is None else theta
    return out


def _sliding_window(arch: str, c: dict, n_layers: int, problems: List[str]) -> int:
    """The one attention window of every layer, read as transformers reads the architecture:
    Llama has none (a ``sliding_window`` key is ignored); Mistral windows every layer by
    ``sliding_window`` (``layer_types`` is ignored); Qwen2 (and Ouro) windows nothing unless
    ``use_sliding_window``, then the layers ``layer_types`` marks sliding, or without it the
    layers from ``max_window_layers`` (default 28) on. Per-layer windows (some layers windowed,
    some not) are a problem."""
    if arch == "MistralForCausalLM":
        types = None
    else:
        types = c.get("layer_types")
        if types is not None:
            if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
                problems.append(f"layer_types={types!r} must be a list of layer type names")
                return 0
            if set(types) - {"full_attention", "sliding_attention"}:
                problems.append(f"layer_types holds {sorted(set(types))}: only full_attention and "
                                f"sliding_attention layers are known")
                return 0
    qwen_like = arch in ("Qwen2ForCausalLM", "OuroForCausalLM")   # Ouro's code derives from Qwen2's
    use = qwen_like and c.get("use_sliding_window", False)
    if arch != "MistralForCausalLM" and not use:
        if types is not None and "sliding_attention" in types:
            why = "use_sliding_window is false" if qwen_like else f"{arch} has no sliding window"
            problems.append(f"layer_types marks sliding_attention layers but {why} (transformers "
                            f"cannot run this config either)")
        return 0
    if qwen_like:
        if types is not None:
            kinds = set(types)
            if len(kinds) == 2:
                problems.append("layer_types mixes full_attention and sliding_attention layers: one "
                                "attention span for every layer is built, not per-layer windows")
                return 0
            if kinds == {"full_attention"}:
                return 0
        else:
            mwl = c.get("max_window_layers", 28)
            if isinstance(mwl, bool) or not isinstance(mwl, int) or mwl < 0:
                problems.append(f"max_window_layers={mwl!r} is not a non-negative integer")
                return 0
            if not isinstance(n_layers, int) or mwl >= n_layers:   # (a bad count: plan_hf says so)
                return 0
            if mwl > 0:
                problems.append(f"use_sliding_window with max_window_layers={mwl}: layers {mwl}.."
                                f"{n_layers - 1} are windowed, the first {mwl} not; per-layer "
                                f"windows are not built")
                return 0
    w = c.get("sliding_window")
    if w is None:
        return 0
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        problems.append(f"sliding_window={w!r} is not a non-negative integer")
        return 0
    return w


def _config_fields(arch: str, c: dict, problems: List[str], notes: List[str]) -> dict:
    """ModelConfig fields of the architecture read from config.json (problems appended)."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if k not in c]
    if missing:
        problems.append(f"config.json lacks {missing}")
        return {}
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):             # transformers' "swish" is SiLU too
        problems.append(f"hidden_act={act!r}: the family's MLP is SwiGLU (silu)")
    for key in _MOE_KEYS:
        if c.get(key):
            problems.append(f"{key}={c[key]!r}: mixture-of-experts layers are not part of the family")
    if arch == "LlamaForCausalLM":     # Mistral's and Qwen2's layers ignore both keys, as transformers does
        if c.get("attention_bias"):
            problems.append("attention_bias=true: biases on q/k/v and o are not built (the family has "
                            "q/k/v biases only, as Qwen2)")
        if c.get("mlp_bias"):
            problems.append("mlp_bias=true: the family's MLP has no biases")
    if c.get("pretraining_tp", 1) not in (1, None):
        notes.append(f"pretraining_tp={c['pretraining_tp']} is ignored (it only splits matmuls)")
    for key in ("tie_word_embeddings", "use_sliding_window", "attention_bias", "mlp_bias"):
        if c.get(key) is not None and not isinstance(c[key], bool):
            problems.append(f"{key}={c[key]!r} must be true or false")
    heads = c["num_attention_heads"]
    fields = dict(
        vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, d_ff=c["intermediate_size"],
        head_dim=c.get("head_dim") or 0,
        norm_eps=c.get("rms_norm_eps", 1e-6), tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        sliding_window=_sliding_window(arch, c, c["num_hidden_layers"], problems), **_rope_fields(c, problems))
    return fields


def _special_ids(model_dir: str, c: dict, problems: List[str], notes: List[str]) -> dict:
    """bos_id, eos_id and extra_eos_ids from config.json, else generation_config.json. An EOS list
    (Llama 3, Qwen2 chat models: end of text and end of turn) gives eos_id its first id and
    extra_eos_ids every other id either file lists, so generation stops on each of them as
    transformers' generate does."""
    gen = {}
    gpath = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gpath):
        gen = read_json(gpath, "generation config")
    out = {}
    for key in ("bos", "eos"):
        name = f"{key}_token_id"
        v = c.get(name)
        if v is None:
            v = gen.get(name)
        out[f"{key}_id"] = _token_id(v, name, problems, notes, key)
    extra = []
    if out["eos_id"] is not None:
        for v in (c.get("eos_token_id"), gen.get("eos_token_id")):
            for t in (v if isinstance(v, list) else [v]):
                if t is None:
                    continue
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    problems.append(f"eos_token_id lists {t!r}, which is not a token id")
                elif t != out["eos_id"] and t not in extra:
                    extra.append(t)
    out["extra_eos_ids"] = tuple(extra)
    return out


def _parse_layers(loop_layers, n_layers: int, problems: List[str]) -> Tuple[int, int]:
    if loop_layers is None:
        return n_layers - 1, n_layers
    if isinstance(loop_layers, str):
        a, sep, b = loop_layers.partition(":")
        try:
            loop_layers = (int(a), int(b))
        except ValueError:
            raise ConfigError(f"--loop-layers {loop_layers!r} must be A:B (two layer indices)") from None
        if not sep:
            raise ConfigError(f"--loop-layers {loop_layers!r} must be A:B (two layer indices)")
    try:
        a, b = loop_layers
    except (TypeError, ValueError):
        raise ConfigError(f"loop_layers={loop_layers!r} must be a pair (A, B)") from None
    for v in (a, b):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"loop_layers={loop_layers!r} must be two integers")
    if not 0 <= a < b <= n_layers:
        raise ConfigError(f"loop_layers {a}:{b} must satisfy 0 <= A < B <= {n_layers} (the "
                          f"checkpoint's num_hidden_layers)")
    return a, b


def _check_init(init_scale, init_seed):
    """(scale, seed) of the random initial state options, validated (None -> 0)."""
    s = 0.0 if init_scale is None else init_scale
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1e6:
        raise ConfigError(f"init_scale={init_scale!r} must be a finite number in [0, 1e6) "
                          f"(0: the loop starts from zeros)")
    seed = 0 if init_seed is None else init_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ConfigError(f"init_seed={init_seed!r} must be an integer in [0, 2**64)")
    if seed and not s:
        raise ConfigError(f"init_seed={init_seed!r} needs init_scale > 0 (a zero start draws nothing)")
    return float(s), int(seed)


def plan_hf(model_dir: str, index: Mapping[str, object], *, loop_layers=None, loops: Optional[int] = None,
            max_loops: Optional[int] = None, init_scale: Optional[float] = None,
            init_seed: Optional[int] = None) -> HFPlan:
    """Resolve a Hugging Face model directory whose tensor headers are `index` ({name: info with
    .shape and .dtype}). Raises ConfigError for bad arguments and ModelFormatError listing every
    reason the checkpoint does not fit. init_scale / init_seed: Huginn's random initial state
    (tinyloop.model.hf_looped; other architectures refuse them)."""
    for name, v, lo in (("loops", loops, 1), ("max_loops", max_loops, 1)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
    if loops is not None and max_loops is not None and max_loops < loops:
        raise ConfigError(f"max_loops={max_loops} is below loops={loops}: the deepest a request may "
                          f"go cannot be shallower than the default depth")
    init_scale, init_seed = _check_init(init_scale, init_seed)
    c = read_hf_config(model_dir)
    archs = c.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        raise ModelFormatError(f"{model_dir!r}: config.json has no architectures entry (one of "
                               f"{list(ARCHITECTURES)})")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"{model_dir!r}: architecture {arch!r} is not supported; supported: "
                               f"{list(ARCHITECTURES)}")
    problems: List[str] = []
    notes: List[str] = []
    if arch == "RavenForCausalLM":
        from .hf_looped import plan_raven
        special = _special_ids(model_dir, c, problems, notes)
        _no_loop_layers(arch, loop_layers)
        cfg, derived = plan_raven(model_dir, c, index, special, loops, max_loops, problems, notes,
                                  init_scale, init_seed)
        return HFPlan(config=cfg, names={}, architecture=arch, notes=notes, derived=derived)
    if init_scale or init_seed:
        raise ConfigError(f"init_scale={init_scale!r} / init_seed={init_seed!r}: a random initial "
                          f"loop state applies to Huginn (RavenForCausalLM) checkpoints only, not {arch}")
    fields = _config_fields(arch, c, problems, notes)
    fields.update(_special_ids(model_dir, c, problems, notes))
    if arch == "OuroForCausalLM":
        from .hf_looped import plan_ouro
        _no_loop_layers(arch, loop_layers)
        cfg, derived = plan_ouro(model_dir, c, index, fields, loops,
                                 max_loops, problems, notes)
        return HFPlan(config=cfg, names={}, architecture=arch, notes=notes, derived=derived)
    if problems:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r} does not fit the model family: "
                               + "; ".join(problems))
    loops = 1 if loops is None else loops
    N = c["num_hidden_layers"]
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r}: num_hidden_layers={N!r} must be a positive "
                               f"integer")
    a, b = _parse_layers(loop_layers, N, problems)
    n_loop = b - a
    if a + loops * n_loop > N:
        raise ConfigError(f"loops={loops}: {loops} copies of layers {a}:{b} need layers up to "
                          f"{a + loops * n_loop - 1}, the checkpoint has {N}")
    post0 = a + loops * n_loop
    try:
        cfg = ModelConfig(n_pre=a, n_loop=n_loop, n_post=N - post0, default_loops=loops,
                          max_loops=max(loops, max_loops or loops), **fields)
    except ConfigError as e:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r}: {e}") from None

    layer_of = {("pre", i): i for i in range(a)}
    layer_of.update({("loop", j): a + j for j in range(n_loop)})
    layer_of.update({("post", i): post0 + i for i in range(N - post0)})
    names: Dict[str, str] = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not cfg.tied_embeddings:
        names["head"] = "lm_head.weight"
    for (part, i), layer in layer_of.items():
        for t in block_tensors(cfg):
            names[f"{part}.{i}.{t}"] = _LAYER.format(i=layer) + _BLOCK_MAP[t]
    tied = [(_LAYER.format(i=a + k * n_loop + j) + _BLOCK_MAP[t], _LAYER.format(i=a + j) + _BLOCK_MAP[t])
            for k in range(1, loops) for j in range(n_loop) for t in block_tensors(cfg)]

    shapes = required_tensors(cfg)
    used = set(names.values()) | {copy for copy, _ in tied}
    missing = sorted(n for n in used if n not in index)
    if missing:
        problems.append(f"missing tensor(s): {_short(missing)}")
    skipped = [n for n in index if n not in used and n.endswith(_IGNORED_SUFFIXES)]
    tied_head = [n for n in index if n == "lm_head.weight" and cfg.tied_embeddings]
    unexpected = sorted(n for n in index if n not in used and n not in skipped and n not in tied_head)
    if unexpected:
        problems.append(f"unexpected tensor(s): {_short(unexpected)}")
    if tied_head:
        notes.append("lm_head.weight is stored but tie_word_embeddings=true: the embedding is the head")
    for logical, hf in names.items():
        info = index.get(hf)
        if info is not None and tuple(info.shape) != tuple(shapes[logical]):
            problems.append(f"{hf}: shape {tuple(info.shape)}, the config implies {tuple(shapes[logical])}")
    for copy, first in tied:
        ci, fi = index.get(copy), index.get(first)
        if ci is not None and fi is not None and (tuple(ci.shape), ci.dtype) != (tuple(fi.shape), fi.dtype):
            problems.append(f"{copy} cannot be a copy of {first} (shape/dtype differ)")
    if problems:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r} does not fit the model family: "
                               + "; ".join(problems))
    return HFPlan(config=cfg, names=names, architecture=arch, tied_copies=tied, notes=notes)


def _no_loop_layers(arch: str, loop_layers) -> None:
    if loop_layers is not None:
        raise ConfigError(f"--loop-layers does not apply to {arch}: its checkpoint says which layers "
                          f"are the loop")


def _short(names: List[str], limit: int = 12) -> str:
    s = ", ".join(names[:limit])
    return s + (f" and {len(names) - limit} more" if len(names) > limit else "")


def find_tokenizer(model_dir: str):
    """The tokenizer files of a model directory: 'tokenizer.json' (preferred), the GPT-2
    vocab.json + merges.txt pair, or None."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return "tokenizer.json"
    if all(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt")):
        return "vocab.json"
    return None
