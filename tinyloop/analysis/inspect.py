"""inspect(): what a .tinyloop file holds and what running it costs, from its header alone.

Memory estimates (see :mod:`tinyloop.analysis.memory`): backend ``cpu`` dequantizes every weight to
float32; backend ``cuda`` keeps the weights packed as stored. KV-cache modes are the registered
cache-mode plugins (their ``kv_bytes_per_element``).
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from ..models import model_path
from ..model.arch import TensorQuant, required_tensors
from ..errors import ConfigError, ModelFormatError
from ..model.format import read_header
from .memory import estimate_memory, parameter_count
from ..runtime.plugins import get_plugin_manager

N_LARGEST = 5
#: Token ids of an embedded tokenizer.json are u32 (the tokenizers library's); others are unreadable.
MAX_TOKEN_ID = 1 << 32


def cache_modes(head_dim: int) -> Dict[str, float]:
    """{cache mode: KV bytes per element} of every registered cache-mode plugin whose codecs are
    registered, for rows of `head_dim` values (scales and zero points included): the loop group's
    codec, which holds all but the pre and post layers."""
    from ..runtime.plugins import get_plugin_manager
    pm = get_plugin_manager()
    codecs = pm.kv_codecs()
    out = {}
    for name, cls in pm.cache_modes().items():
        codec = codecs.get(cls.group_codec("loop"))
        if codec is not None:
            out[name] = codec.row_bytes(head_dim) / head_dim
    return out


def _part_of(name: str) -> str:
    return name.split(".", 1)[0] if "." in name else name


def _hf_tokenizer_info(text) -> dict:
    """Token count, id range and model type of an embedded tokenizer.json, read as JSON only (the
    tokenizers library is not needed to inspect a file); what cannot be read is reported as such."""
    import json
    try:
        d = json.loads(text)
        model = d.get("model") or {}
        vocab = model.get("vocab")
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))
        ids += [t.get("id") for t in d.get("added_tokens") or [] if isinstance(t, dict)]
        ids = [i for i in ids if isinstance(i, int)]
        if any(not 0 <= i < MAX_TOKEN_ID for i in ids):   # (an id of 4300 digits cannot even be printed)
            raise ValueError(f"token id outside [0, {MAX_TOKEN_ID})")
        return {"tokens": len(set(ids)), "vocab_size": (max(ids) + 1) if ids else 0,
                "model": str(model.get("type")), "merges": len(model.get("merges") or []),
                "json_bytes": len(text)}
    except (TypeError, ValueError, AttributeError, RecursionError) as e:
        return {"tokens": 0, "vocab_size": 0, "model": f"unreadable ({type(e).__name__})", "merges": 0}


def inspect(path=None, max_seq_len: int = 2048, loops: Optional[int] = None, measure: bool = False,
            prefill_chunk: int = 0) -> dict:
    """Metadata, architecture, tensor-table summary, embedded tokenizer and memory estimates per
    backend and cache mode, as a JSON-serializable dict. Reads the header only, never the weights.

    ``measure=True`` is the exception: it also loads the model on the CPU backend and runs it to add
    "loop_gain" (:func:`tinyloop.analysis.loopgain.measure_file` with its defaults: the sample text, 4
    windows of 256 tokens, depths 1 .. min(2 x default_loops, max_loops)); seconds to minutes."""
    if not isinstance(measure, bool) and type(measure).__name__ != "bool_":      # (numpy's bool too)
        raise ConfigError(f"measure must be True or False, got {measure!r:.40}")
    path = model_path(path)
    if not os.path.exists(path):
        raise ModelFormatError(f"no such file: {path}")
    if os.path.isdir(path):
        raise ModelFormatError(f"{path} is a directory, not a model file")
    h = read_header(path)
    cfg = h.config
    shapes = required_tensors(cfg)
    quant = dict(h.quant or {})

    # logical -> its physical tensors
    phys_owner = {}
    for name, shape in shapes.items():
        tq = quant.get(name, TensorQuant("f32"))
        for pname in tq.physical(name, shape):
            phys_owner[pname] = name
    by_dtype: Dict[str, dict] = {}
    bytes_by_quant: Dict[str, int] = {}
    tensors_by_quant: Dict[str, int] = {}
    logical_bytes: Dict[str, int] = {}
    for t in h.tensors:
        d = by_dtype.setdefault(str(t.dtype), {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += int(t.nbytes)
        owner = phys_owner.get(t.name, t.name)
        logical_bytes[owner] = logical_bytes.get(owner, 0) + int(t.nbytes)
    for name in shapes:
        tq = quant.get(name, TensorQuant("f32"))
        key = tq.type if not tq.bits else f"{tq.type}/g{tq.group_size}"
        bytes_by_quant[key] = bytes_by_quant.get(key, 0) + logical_bytes.get(name, 0)
        tensors_by_quant[key] = tensors_by_quant.get(key, 0) + 1
    largest = sorted(h.tensors, key=lambda t: (-int(t.nbytes), t.name))[:N_LARGEST]

    params_by_part: Dict[str, int] = {}
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        params_by_part[_part_of(name)] = params_by_part.get(_part_of(name), 0) + n
    params = parameter_count(cfg)

    tok = h.tokenizer
    if isinstance(tok, dict) and tok.get("type") == "hf":
        tok_info = {"embedded": True, "type": "hf", **_hf_tokenizer_info(tok.get("json")),
                    "chat_template": tok.get("chat_template") is not None}
    elif isinstance(tok, dict):
        vocab = tok.get("vocab") if isinstance(tok.get("vocab"), dict) else {}
        ids = [i for i in vocab.values() if isinstance(i, int)]
        tok_info = {"embedded": True, "type": tok.get("type"), "tokens": len(vocab),
                    "vocab_size": (max(ids) + 1) if ids else 0,
                    "merges": len(tok.get("merges") or [])}
    else:
        tok_info = {"embedded": False}

    loops = cfg.default_loops if loops is None else loops
    modes = cache_modes(cfg.head_dim)
    memory = {}
    for backend, entry in get_plugin_manager().backends().items():
        memory[backend] = {"note": entry.description, "cache_modes": {}}
        for mode, kvb in modes.items():
            memory[backend]["cache_modes"][mode] = estimate_memory(
                h, max_seq_len, loops, kvb, backend=backend, prefill_chunk=prefill_chunk)

    d = {
        "file": path,
        "file_size": int(h.file_size),
        "version": h.version,
        "data_offset": int(h.data_offset),
        "metadata": dict(h.metadata or {}),
        "config": cfg.to_dict(),
        "architecture": {
            "q_dim": cfg.q_dim, "kv_dim": cfg.kv_dim, "head_dim": cfg.head_dim,
            "gqa_group": cfg.n_heads // cfg.n_kv_heads,
            "distinct_blocks": cfg.n_pre + cfg.n_loop + cfg.n_post,
            "layers_at_default_loops": cfg.n_layers(cfg.default_loops),
            "layers_at_max_loops": cfg.n_layers(cfg.max_loops),
        },
        "parameters": params,
        "parameters_by_part": params_by_part,
        "tensors": {
            "count": len(h.tensors),
            "bytes": sum(int(t.nbytes) for t in h.tensors),
            "by_dtype": by_dtype,
            "logical_by_quant": tensors_by_quant,
            "bytes_by_quant": bytes_by_quant,
            "largest": [{"name": t.name, "dtype": str(t.dtype), "shape": list(t.shape),
                         "bytes": int(t.nbytes)} for t in largest],
        },
        "tokenizer": tok_info,
        "memory": {"max_seq_len": max_seq_len, "loops": loops, "cache_modes": modes,
                   "backends": memory},
    }
    if measure:
        from .loopgain import measure_file
        d["loop_gain"] = measure_file(path)
    return d
