"""INT4 weight-only PyTorch baseline for bench/decode_bench.py: the tinygemm kernel
(``torch.ops.aten._weight_int4pack_mm``, what gpt-fast and torchao run for batch-1 decode), bf16
activations and KV cache, group size 128, the decode step compiled with ``torch.compile`` and
captured in a CUDA graph.

The quantization math is numpy (checked without a GPU or torch in tests/test_bench_tools.py);
torch is imported only by the functions that build and run the model.

Convention (tinygemm's, as in PyTorch's own test of ``_weight_int4pack_mm`` and gpt-fast's
``group_quantize_tensor``): a weight ``w`` (N, K) in F.linear layout is split along K into groups
of ``group`` elements; each group has a bf16 ``scale`` and a bf16 ``zero`` and every element a code
``q`` in [0, 15] with::

    w ~= (q - 8) * scale + zero          scale = (max - min) / 15,  zero = min + 8 * scale

Scale and zero are rounded to bf16 *before* the codes are chosen, so the codes are the nearest
ones for the parameters the kernel actually reads, and :func:`dequantize` is exactly the matrix
the kernel multiplies by. Codes go to ``_convert_weight_to_int4pack`` as uint8 (N, K/2), two per
byte, element 2j in the HIGH nibble of byte j; scales and zeros as one bf16 tensor (K/group, N, 2).
"""

from __future__ import annotations

import time
from typing import Dict, Mapping, Tuple

import numpy as np

GROUP = 128
#: group sizes tinygemm supports, in order of preference (the bench's default is GROUP)
GROUPS = (128, 64, 32, 256)
#: tinygemm's packing factors, fastest first: K must be a multiple of 16 * inner_k_tiles
INNER_K_TILES = (8, 4, 2)
#: The largest max-abs error of a checked int4 matmul, relative to the reference's max-abs value,
#: that the bench row accepts: against the matrix the kernel holds (bf16 rounding of the output
#: only; a packing or layout mistake gives ~1) and against the logical weights (plus the
#: re-quantization: small on tinyloop's own grid, ~0.1 for a min/max grid of random weights).
MAX_REL_ERR_KERNEL = 2e-2
MAX_REL_ERR_LOGICAL = 0.25


def pick_group(cfg) -> int:
    """The tinygemm group size for a model: GROUP where every matrix's in_features allows it,
    else the first of GROUPS that divides them all (Huginn-0125's d_model 5280 needs 32)."""
    ins = {cfg.d_model, cfg.q_dim, cfg.d_ff}
    for g in GROUPS:
        if all(k % g == 0 for k in ins):
            return g
    raise ValueError(f"no tinygemm group size in {GROUPS} divides the in_features {sorted(ins)}")


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def group_quantize(w: np.ndarray, group: int = GROUP, grid=None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit quantization of w (N, K) in groups of ``group`` along K.

    ``grid`` = (scales, zeros) float32 (N, K/group) in the tinygemm convention keeps a given grid
    (a tinyloop q4 tensor's own, see :func:`load_grids`); without it each group's grid spans its
    min and max. Returns (codes uint8 (N, K) in [0, 15], scales float32 (N, K/group), zeros float32
    (N, K/group)); scales and zeros are bf16 values (see the module docstring)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % group:
        raise ValueError(f"weight of shape {w.shape}: need 2-D with K a multiple of {group}")
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    if grid is None:
        lo, hi = g.min(-1), g.max(-1)
        scale = bf16_round(np.maximum(hi - lo, 1e-6) / 15.0)
        zero = bf16_round(lo + 8.0 * scale)
    else:
        scale, zero = (bf16_round(np.asarray(a, np.float32).reshape(N, K // group)) for a in grid)
    q = np.rint((g - zero[..., None]) / np.where(scale == 0, 1, scale)[..., None]) + 8.0
    codes = np.clip(q, 0, 15).astype(np.uint8).reshape(N, K)
    return codes, scale, zero


def tinyloop_grid(scales: np.ndarray, zeros: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """A tinyloop q4 grid, w = (q - zero) * scale (fp16 scales, integer zeros), in the tinygemm
    convention w = (q - 8) * scale + zero': the same codes, zero' = (8 - zero) * scale."""
    s = np.asarray(scales, np.float32)
    return s, (8.0 - np.asarray(zeros, np.float32)) * s


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """(q - 8) * scale + zero per group: the float32 matrix (N, K) the int4 kernel multiplies by."""
    N, K = codes.shape
    G = scales.shape[1]
    q = codes.reshape(N, G, K // G).astype(np.float32) - 8.0
    return (q * scales[..., None] + zeros[..., None]).reshape(N, K)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes (N, K) -> uint8 (N, K/2): element 2j in the high nibble of byte j, 2j+1 low
    (the input layout of ``_convert_weight_to_int4pack``)."""
    c = np.asarray(codes, dtype=np.uint8)
    return ((c[:, ::2] << np.uint8(4)) | c[:, 1::2]).astype(np.uint8)


def scales_and_zeros(scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """(N, K/group) scales and zeros -> one float32 array (K/group, N, 2), [..., 0] the scale."""
    return np.ascontiguousarray(np.stack([scales, zeros], axis=-1).transpose(1, 0, 2))


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    """max |y - ref| / max |ref|."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


# --------------------------------------------------------------------------- torch side
def inner_k_tiles(K: int) -> int:
    """The largest tinygemm inner_k_tiles the in_features K allows (8 for K % 128 == 0; Huginn's
    d_model 5280 needs 2)."""
    for t in INNER_K_TILES:
        if K % (16 * t) == 0:
            return t
    raise ValueError(f"in_features {K} is not a multiple of {16 * INNER_K_TILES[-1]} (tinygemm's packing)")


def to_tinygemm(codes, scales, zeros, device="cuda"):
    """The (packed weight, scales_and_zeros, group size) that ``_weight_int4pack_mm`` takes."""
    import torch
    u8 = torch.from_numpy(pack_nibbles(codes)).to(device)
    packed = torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles(codes.shape[1]))
    sz = torch.from_numpy(scales_and_zeros(scales, zeros)).to(device=device, dtype=torch.bfloat16)
    return packed, sz, codes.shape[1] // scales.shape[1]


def int4_linear(x, w):
    """F.linear(x, W) for W given as (packed, scales_and_zeros, group); x bf16 (..., K)."""
    import torch
    packed, sz, group = w
    K = x.shape[-1]
    y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, K).contiguous(), packed, group, sz)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quantize_for_torch(logical: Mapping[str, np.ndarray], cfg, grids=None, check_rows: int = 4, seed: int = 0,
                       device="cuda", group: int = GROUP):
    """Quantize the model's matrices for tinygemm: per block q|k|v, wo, gate|up, w_down (fused like
    tinyloop's kernels) and the head, on the grids of ``grids`` (:func:`load_grids`) where given.
    Each packed matrix is checked on ``check_rows`` random bf16 input rows against the dequantized
    matrix it holds (the packing and the kernel) and against the logical weights (plus the
    re-quantization).

    Returns ({block prefix: {"qkv", "wo", "gate_up", "w_down": (packed, sz, group)}, and
    "model": the loop adapter's halves where the model has them}, head (packed, sz, group),
    check dict with the max relative errors). Raises RuntimeError when a check is way off."""
    import torch
    grids = grids or {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    worst = {"kernel": 0.0, "logical": 0.0}
    per = {}

    def grid_of(names):
        if not all(n in grids for n in names):
            return None
        return tuple(np.concatenate([grids[n][i] for n in names]) for i in (0, 1))

    def one(label, names):
        w_logical = np.concatenate([logical[n] for n in names]) if len(names) > 1 else logical[names[0]]
        codes, s, z = group_quantize(w_logical, group, grid_of(names))
        w = to_tinygemm(codes, s, z, device)
        x = torch.randn(check_rows, w_logical.shape[1], generator=gen).to(torch.bfloat16)
        xf = x.float().numpy()
        y = int4_linear(x.to(device), w).float().cpu().numpy()
        e_k = rel_err(y, xf @ dequantize(codes, s, z).T)
        e_l = rel_err(y, xf @ np.asarray(w_logical, np.float32).T)
        per[label] = {"kernel": e_k, "logical": e_l, "grid": "tinyloop" if grid_of(names) else "min/max"}
        worst["kernel"], worst["logical"] = max(worst["kernel"], e_k), max(worst["logical"], e_l)
        if not (e_k <= MAX_REL_ERR_KERNEL and e_l <= MAX_REL_ERR_LOGICAL):
            raise RuntimeError(f"int4 matmul check failed for {label}: max rel err {e_k:.3g} against "
                               f"the quantized matrix, {e_l:.3g} against the logical weights")
        return w

    blocks = {}
    prefixes = ([f"pre.{i}" for i in range(cfg.n_pre)] + [f"loop.{i}" for i in range(cfg.n_loop)]
                + [f"post.{i}" for i in range(cfg.n_post)])
    for p in prefixes:
        blocks[p] = {"qkv": one(f"{p}.qkv", [f"{p}.wq", f"{p}.wk", f"{p}.wv"]),
                     "wo": one(f"{p}.wo", [f"{p}.wo"]),
                     "gate_up": one(f"{p}.gate_up", [f"{p}.w_gate", f"{p}.w_up"]),
                     "w_down": one(f"{p}.w_down", [f"{p}.w_down"])}
    if cfg.loop_inject == "adapter":
        blocks["model"] = {n: one(n, [n]) for n in ("loop_adapter_x", "loop_adapter_e")}
    head = one("head", ["embed" if cfg.tied_embeddings else "head"])
    return blocks, head, {"max_rel_err_vs_quantized": worst["kernel"],
                          "max_rel_err_vs_logical": worst["logical"], "rows": check_rows,
                          "grids": sorted({v["grid"] for v in per.values()}), "per_matrix": per}


def layer_caches(model, n_layers: int):
    """One K and one V tensor per cache layer, each its own allocation, shaped like a layer of
    model.k_cache (gpt-fast's layout). Under torch.compile an in-place write into a slice of one
    shared cache tensor becomes a copy of the whole layer and a copy back; into a tensor of its
    own it stays in place."""
    import torch
    kc = model.k_cache
    return ([torch.zeros_like(kc[0]) for _ in range(n_layers)],
            [torch.zeros_like(kc[0]) for _ in range(n_layers)])


def ops_attention(q, ck, cv, mask, scale):
    """Softmax attention of one query row written in plain ops, float32 (for inductor to fuse):
    q (B, H, 1, hd), ck / cv (B, H, S, hd), mask (1, 1, 1, S) bool -> (B, H, 1, hd) in q's dtype."""
    import torch
    S = ck.shape[2]
    s = (q.float() * ck.float()).sum(-1) * scale                          # (B, H, S)
    s = s.masked_fill(~mask.view(1, 1, S), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return (p.unsqueeze(-1) * cv.float()).sum(-2, keepdim=True).to(q.dtype)


def make_int4_step(model, blocks, head, loops: int, caches=None, attention: str = "sdpa",
                   compile_blocks: bool = False):
    """step(tok, pos) -> logits (B, V): LoopedLM.decode_one with every matmul on tinygemm (the
    model supplies embedding, norms, RoPE tables and the trunk order). The KV cache is the model's
    (one tensor, a slice per layer) or ``caches`` = (K list, V list) from :func:`layer_caches`;
    ``attention`` is "sdpa" (F.scaled_dot_product_attention with the mask, as torch_model) or
    "ops" (:func:`ops_attention`). ``compile_blocks``: the block function goes through
    torch.compile (one compilation per distinct block, so the compile time does not grow with
    ``loops``); the rest of the step stays eager ops."""
    import torch
    import torch.nn.functional as F

    from tinyloop.torch_model import apply_rope, rms_norm

    if attention not in ("sdpa", "ops"):
        raise ValueError(f"attention={attention!r} is not 'sdpa' or 'ops'")
    for p, b in ([(f"pre.{i}", b) for i, b in enumerate(model.pre)]
                 + [(f"loop.{i}", b) for i, b in enumerate(model.loop)]
                 + [(f"post.{i}", b) for i, b in enumerate(model.post)]):
        b.int4 = blocks[p]                                # a plain attribute (a dict): not a parameter
        b.int4_bias = torch.cat([b.bq, b.bk, b.bv]).detach() if b.qkv_bias else None

    def block_step(b, x, cos, sin, pos_idx, mask, ck, cv):
        B, T, _ = x.shape
        w = b.int4
        h = rms_norm(x, b.attn_norm, b.eps)
        qkv = int4_linear(h, w["qkv"])
        if b.int4_bias is not None:
            qkv = qkv + b.int4_bias
        q, k, v = qkv.split([b.n_heads * b.hd, b.n_kv * b.hd, b.n_kv * b.hd], dim=-1)
        q = apply_rope(q.reshape(B, T, b.n_heads, b.hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.reshape(B, T, b.n_kv, b.hd).transpose(1, 2), cos, sin)
        v = v.reshape(B, T, b.n_kv, b.hd).transpose(1, 2)
        ck.index_copy_(2, pos_idx, k)
        cv.index_copy_(2, pos_idx, v)
        if attention == "sdpa":
            att = F.scaled_dot_product_attention(q, b._expand(ck), b._expand(cv), attn_mask=mask, scale=b.scale)
        else:
            att = ops_attention(q, b._expand(ck), b._expand(cv), mask, b.scale)
        x = b.residual(x, int4_linear(att.transpose(1, 2).reshape(B, T, b.n_heads * b.hd), w["wo"]),
                       getattr(b, "attn_out_norm", None))
        h = rms_norm(x, b.mlp_norm, b.eps)
        g, u = int4_linear(h, w["gate_up"]).chunk(2, dim=-1)
        return b.residual(x, int4_linear(F.silu(g) * u, w["w_down"]), getattr(b, "mlp_out_norm", None))

    if compile_blocks:
        import torch._dynamo as dynamo
        n_blocks = len(model.pre) + len(model.loop) + len(model.post)
        for knob in ("cache_size_limit", "recompile_limit"):       # one entry per distinct block
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), 2 * n_blocks))
        block_step = torch.compile(block_step, fullgraph=True, dynamic=False)

    model_w = blocks.get("model", {})

    def linear(v, name):
        return int4_linear(v, model_w[name])

    def step(tok, pos):
        kc, vc = (model.k_cache, model.v_cache) if caches is None else caches
        B, S = kc[0].shape[0], kc[0].shape[2]
        pos_idx = pos.reshape(1)
        cos, sin = model.rope_cos[pos_idx], model.rope_sin[pos_idx]
        mask = (model._positions[:S] <= pos_idx).view(1, 1, 1, S)
        x = model._embed(tok.reshape(B, 1))
        x = model._trunk(x, loops, lambda b, x, layer: block_step(b, x, cos, sin, pos_idx, mask,
                                                                  kc[layer], vc[layer]), linear,
                             rows=pos_idx)
        return model._logits(x, lambda v: int4_linear(v, head))[:, 0]

    return step


def load_logical(path: str) -> Dict[str, np.ndarray]:
    """{logical name: float32 array} of a .tinyloop file (the dequantized tensors tinyloop runs)."""
    from tinyloop.model.format import open_model
    with open_model(path) as mf:
        return {n: np.array(mf.logical(n), dtype=np.float32) for n in mf.header.quant}


def load_grids(path: str, group: int = GROUP) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{logical name: (scales, zeros) in the tinygemm convention} of the file's q4 tensors with
    group size `group`: re-quantizing their logical values on these grids gives back tinyloop's
    own codes (a min/max grid would not where a group leaves its top or bottom code unused)."""
    from tinyloop.model.format import open_model
    out = {}
    with open_model(path) as mf:
        for n, tq in mf.header.quant.items():
            if tq.type == "q4" and tq.group_size == group:
                out[n] = tinyloop_grid(mf.tensors[f"{n}.scales"], mf.tensors[f"{n}.zeros"])
    return out


def timed_quantize(logical, cfg, grids=None, group: int = GROUP):
    t = time.perf_counter()
    blocks, head, check = quantize_for_torch(logical, cfg, grids, group=group)
    check["quantize_s"] = time.perf_counter() - t
    return blocks, head, check
