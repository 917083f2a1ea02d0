#!/usr/bin/env python3
"""Train TinyLoop's demo looped LM on the corpus made by tools/build_corpus.py.

Runs on one GPU (bf16 autocast) or, for smoke tests, on the CPU (float32). Imports only the
standard library, numpy, torch, safetensors and this repository's ``tinyloop.model.arch`` /
``tinyloop.torch_model`` (found through the repository root, no install needed).

Inputs (``--data-dir``, default ``build/demo``): ``train_ids.npy`` and ``heldout_ids.npy`` (uint16
ids, files joined with the EOS id) and ``meta.json`` (vocab_size, eos_id; ``--vocab-size`` /
``--eos-id`` override it).

Training:

* AdamW (betas 0.9/0.95, weight decay on 2-D tensors only, fused on CUDA), gradient clipping 1.0,
  linear warmup then cosine decay to ``--min-lr-frac`` of the peak;
* each step draws ``--batch-size`` random contiguous windows of ``--seq-len`` + 1 tokens
  (numpy ``default_rng(seed)``) and one loop count L for the whole step from a separate stream
  (``default_rng([seed, 1])``): with probability ``--p-default`` L = default_loops, otherwise L is
  uniform on 1 .. ``--train-max-loops`` (default 2 * default_loops). Half the steps thus train the
  depth the model will usually run at, the rest keep it usable from L = 1 up to twice that depth
  (mean L = 4.25 for default_loops 4); the loss is taken after the last iteration only, or, with
  ``--exit-train deep``, also at every earlier depth d < L as if every token left the loop there
  (the post blocks and head on the depth-d state), each weighted ``--depth-weight`` against the
  last depth's 1: a model whose early depths are already good, so early exit saves iterations
  cheaply. ``--exit-gate`` adds a learned exit gate (Ouro's: one logit of the loop state) trained
  beside it by binary cross-entropy on detached states, the label of a token at depth d being
  "its loss there is within ``--gate-margin`` nats of the last depth's"; the runtime's ``gate``
  early-exit criterion reads it;
* ``--time-budget-s`` bounds the training loop's wall clock: the schedule's progress is
  ``max(step / steps, elapsed / budget)``, so when the budget binds the LR still anneals to its
  floor and training stops gracefully (evaluation and saving follow). A run where the budget
  does not bind is reproducible given --seed (init, batches, loop counts); CUDA runs are not
  bit-exact (bf16 autocast, SDPA/flash backward and cuBLAS reductions may be nondeterministic;
  TF32 is allowed for the few float32 matmuls, cudnn.benchmark is off).
* every ``--eval-every`` steps: held-out and train-sample loss at default_loops; at the end:
  held-out loss at L in ``--eval-loops`` (default 1, 2, default, 2*default, max_loops).

Outputs (``--out``): ``model.safetensors`` (logical tensor names, float32), ``config.json``
(``ModelConfig.to_dict()``: bos_id None, eos_id = the EOS id), ``train_log.json`` (args, config,
parameter count, predicted INT4 file size, steps, time, losses, evals per L), ``train.log``.
The device machine returns files of at most 16 MiB, so weights larger than ``--max-shard-mib``
(default 15) are written as HF-style shards ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (the default model: 31.5 MB float32 -> 3 shards; 7 files in all).
Join them afterwards, anywhere, with
``python tools/train_demo.py --merge-shards <dir with shards> --out <model dir>`` (numpy +
safetensors only), which also copies config.json, the logs and build/demo's vocab.json/merges.txt.

Default shape (tied embeddings, loop_inject "add"): vocab 4096, d_model 384, 6 heads (head_dim 64),
2 kv heads, d_ff 1024, 1 pre + 2 loop + 1 post blocks, default_loops 4, max_loops 16:
7,867,776 parameters; stored with q4/group 64 block matrices, f16 embed, f32 norms the tensor
payload is 6.60 MB (5.10 MB with a q8 embed) -- under the 8 MB target with room for the header and
the embedded tokenizer.

Smoke test: python tools/train_demo.py --device cpu --steps 5 --d-model 64 --n-heads 4
            --n-kv-heads 2 --d-ff 128 --seq-len 64 --batch-size 4 --out /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _light_packages() -> None:
    """Make ``tinyloop`` and ``tinyloop.model`` importable WITHOUT running their __init__.py (the
    runtime's public API pulls in pluggy, numba kernels ...): this script needs only
    tinyloop.model.arch / errors and tinyloop.torch_model, which import nothing beyond torch.
    Does nothing when the package is already imported (e.g. under pytest)."""
    import types
    for name, rel in (("tinyloop", "tinyloop"), ("tinyloop.model", os.path.join("tinyloop", "model"))):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(REPO, rel)]
            mod.__package__ = name
            sys.modules[name] = mod


_light_packages()
from tinyloop.model.arch import ModelConfig, TensorQuant, is_matrix, required_tensors  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402

BYTES = {"f32": 4, "f16": 2, "u8": 1}


def predicted_payload_bytes(cfg: ModelConfig, quant: str = "q4", group: int = 64,
                            embed_quant: str = "f16"):
    """Bytes of the stored tensors (no header/tokenizer): matrices `quant`/`group`, embed/head
    `embed_quant`, norms f32. None when a dimension is not a multiple of the group size."""
    try:
        return _payload_bytes(cfg, quant, group, embed_quant)
    except ConfigError:
        return None


def _payload_bytes(cfg: ModelConfig, quant: str, group: int, embed_quant: str) -> int:
    total = 0
    for name, shape in required_tensors(cfg).items():
        if name in ("embed", "head"):
            tq = TensorQuant(embed_quant, group if embed_quant in ("q8", "q4", "q2") else 0)
        elif is_matrix(name):
            tq = TensorQuant(quant, group)
        else:
            tq = TensorQuant("f32")
        for dt, shp in tq.physical(name, shape).values():
            total += BYTES[dt] * int(np.prod(shp))
    return total


SHARD_INDEX = "model.safetensors.index.json"


def save_weights(arrays, out_dir: str, metadata: dict, max_shard_bytes: int):
    """Write {name: float32 array} as model.safetensors, or, when larger than max_shard_bytes (0 =
    never shard), as HF-style shards model-0000i-of-0000n.safetensors (whole tensors, canonical
    order) plus model.safetensors.index.json. Removes weight files of an earlier run in out_dir.
    Returns the file names written."""
    from safetensors.numpy import save_file
    for fn in os.listdir(out_dir):
        if fn == SHARD_INDEX or (fn.startswith("model") and fn.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, fn))
    total = sum(a.nbytes for a in arrays.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        save_file(arrays, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return ["model.safetensors"]
    shards, cur, size = [], {}, 0
    for k, a in arrays.items():
        if cur and size + a.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = a
        size += a.nbytes
    shards.append(cur)
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata=metadata)
        names.append(name)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(out_dir, SHARD_INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}, f, indent=1)
        f.write("\n")
    return names + [SHARD_INDEX]


def merge_shards(src: str, dst: str, tokenizer_dir: str = "") -> str:
    """Join the shards in src (model.safetensors.index.json) into dst/model.safetensors, copy
    config.json / train_log.json / train.log from src and vocab.json / merges.txt from
    tokenizer_dir when present. Needs only numpy + safetensors."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    os.makedirs(dst, exist_ok=True)
    single = os.path.join(src, "model.safetensors")
    index_path = os.path.join(src, SHARD_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        arrays, metadata = {}, None
        for name in dict.fromkeys(index["weight_map"].values()):
            with safe_open(os.path.join(src, name), framework="np") as f:
                metadata = metadata or f.metadata()
                for k in f.keys():
                    arrays[k] = f.get_tensor(k)
        missing = set(index["weight_map"]) - set(arrays)
        if missing:
            raise SystemExit(f"shards lack tensors {sorted(missing)}")
        arrays = {k: arrays[k] for k in index["weight_map"]}        # canonical order
        save_file(arrays, os.path.join(dst, "model.safetensors"), metadata=metadata)
    elif os.path.isfile(single):
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(single, os.path.join(dst, "model.safetensors"))
    else:
        raise SystemExit(f"{src} holds neither {SHARD_INDEX} nor model.safetensors")
    copies = [(src, fn) for fn in ("config.json", "train_log.json", "train.log")]
    if tokenizer_dir:
        copies += [(tokenizer_dir, fn) for fn in ("vocab.json", "merges.txt")]
    for d, fn in copies:
        p = os.path.join(d, fn)
        if os.path.isfile(p) and os.path.abspath(d) != os.path.abspath(dst):
            shutil.copyfile(p, os.path.join(dst, fn))
    return os.path.join(dst, "model.safetensors")


def _mb(n) -> str:
    return "n/a (dims not multiples of 64)" if n is None else f"{n / 1e6:.2f} MB"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the TinyLoop demo looped LM.")
    a = ap.add_argument
    a("--data-dir", default=os.path.join(REPO, "build", "demo"))
    a("--out", default=os.path.join(REPO, "build", "demo_model"))
    a("--device", default=None, help="cuda or cpu (default: cuda if available)")
    a("--seed", type=int, default=1234)
    # shape
    a("--vocab-size", type=int, default=None, help="default: meta.json")
    a("--eos-id", type=int, default=None, help="default: meta.json")
    a("--d-model", type=int, default=384)
    a("--n-heads", type=int, default=6)
    a("--n-kv-heads", type=int, default=2)
    a("--d-ff", type=int, default=1024)
    a("--n-pre", type=int, default=1)
    a("--n-loop", type=int, default=2)
    a("--n-post", type=int, default=1)
    a("--default-loops", type=int, default=4)
    a("--max-loops", type=int, default=16)
    a("--loop-inject", default="add", choices=["none", "add"])
    a("--untied", action="store_true", help="separate head matrix (default: tied embeddings)")
    a("--rope-theta", type=float, default=10000.0)
    # optimisation
    a("--steps", type=int, default=1200)
    a("--batch-size", type=int, default=128)
    a("--seq-len", type=int, default=512)
    a("--lr", type=float, default=2e-3)
    a("--min-lr-frac", type=float, default=0.1)
    a("--warmup", type=int, default=100)
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--p-default", type=float, default=0.5, help="probability a step uses default_loops")
    a("--init-from", default=None, metavar="FILE.tinyloop",
      help="start from this model's weights (dequantized; the shape flags must match it; an exit gate it "
           "lacks starts at zero): fine-tuning, e.g. the demo model for --exit-train deep")
    a("--exit-train", default="none", choices=["none", "deep"],
      help="deep: the loss is also taken at every earlier exit depth (module docstring)")
    a("--depth-weight", type=float, default=1.0,
      help="--exit-train deep: weight of each earlier depth's loss against the last depth's 1")
    a("--exit-gate", action="store_true", help="learn an exit gate (ModelConfig.exit_gate); needs --exit-train deep")
    a("--gate-margin", type=float, default=0.05,
      help="a token's exit label at depth d is 1 when its loss there is within this many nats of the last depth's")
    a("--train-max-loops", type=int, default=None, help="default: min(2*default_loops, max_loops)")
    a("--time-budget-s", type=float, default=330.0, help="training-loop wall clock limit; 0 = none")
    a("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    a("--compile", action="store_true", help="torch.compile the model (compile time counts)")
    # logging / eval
    a("--log-every", type=int, default=20)
    a("--eval-every", type=int, default=200)
    a("--eval-tokens", type=int, default=1 << 17, help="tokens per periodic eval (held-out and train)")
    a("--final-eval-tokens", type=int, default=0, help="held-out tokens for the final eval; 0 = all")
    a("--eval-loops", default=None, help="comma list; default 1,2,default,2*default,max")
    # output
    a("--max-shard-mib", type=float, default=15.0,
      help="shard model.safetensors above this size (the device returns files <= 16 MiB); 0 = never")
    a("--merge-shards", metavar="SRC", default=None,
      help="do not train: join SRC's shards into --out/model.safetensors, copy config/logs and "
           "--data-dir's vocab.json/merges.txt")
    return ap.parse_args(argv)


def init_from(model, path: str) -> str:
    """Copy a .tinyloop file's tensors (dequantized to float32) into `model`, whose config must
    have the same shape; tensors the file lacks (a new exit gate) keep their initial values."""
    import torch
    from tinyloop.model.format import open_model
    with open_model(path) as mf:
        src = mf.header.config
        keys = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff", "n_pre", "n_loop", "n_post",
                "tied_embeddings", "loop_inject")
        diff = [f"{k}: file {getattr(src, k)!r}, flags {getattr(model.config, k)!r}" for k in keys
                if getattr(src, k) != getattr(model.config, k)]
        if diff:
            raise SystemExit(f"--init-from {path}: the shape differs ({'; '.join(diff)})")
        have = set(required_tensors(src))
        params = dict(model.named_parameters())
        copied = []
        with torch.no_grad():
            for name in required_tensors(model.config):
                if name in have:
                    params[name].copy_(torch.from_numpy(np.asarray(mf.logical(name), np.float32)))
                    copied.append(name)
    kept = sorted(set(required_tensors(model.config)) - set(copied))
    return f"{len(copied)} tensors from {path}" + (f"; initial values kept for {kept}" if kept else "")


def sample_loops(rng, n_default: int, hi: int, p_default: float) -> int:
    if rng.random() < p_default:
        return n_default
    return int(rng.integers(1, hi + 1))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge_shards:
        path = merge_shards(args.merge_shards, args.out, args.data_dir)
        print(f"wrote {path}")
        return {"merged": path}
    import torch
    import torch.nn.functional as F
    from tinyloop.torch_model import LoopedLM

    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "train.log")
    logf = open(log_path, "w", encoding="utf-8")

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    # ---------------------------------------------------------------- data
    meta = {}
    meta_path = os.path.join(args.data_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    vocab_size = args.vocab_size if args.vocab_size is not None else meta.get("vocab_size")
    eos_id = args.eos_id if args.eos_id is not None else meta.get("eos_id")
    if vocab_size is None or eos_id is None:
        raise SystemExit(f"no vocab_size/eos_id: give --vocab-size/--eos-id or put meta.json in {args.data_dir}")
    train_np = np.load(os.path.join(args.data_dir, "train_ids.npy"))
    held_np = np.load(os.path.join(args.data_dir, "heldout_ids.npy"))
    for name, arr in (("train", train_np), ("heldout", held_np)):
        if arr.ndim != 1 or arr.size < args.seq_len + 2:
            raise SystemExit(f"{name}_ids.npy must be 1-D with more than seq_len + 1 tokens")
        if int(arr.max()) >= vocab_size:
            raise SystemExit(f"{name}_ids.npy has id {int(arr.max())} >= vocab_size {vocab_size}")

    # ---------------------------------------------------------------- model
    cfg = ModelConfig(vocab_size=vocab_size, d_model=args.d_model, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, d_ff=args.d_ff, n_pre=args.n_pre,
                      n_loop=args.n_loop, n_post=args.n_post, default_loops=args.default_loops,
                      max_loops=args.max_loops, rope_theta=args.rope_theta,
                      tied_embeddings=not args.untied, loop_inject=args.loop_inject,
                      exit_gate=args.exit_gate, bos_id=None, eos_id=eos_id)
    if args.exit_gate and args.exit_train != "deep":
        raise SystemExit("--exit-gate needs --exit-train deep (the gate learns from every depth's loss)")
    if not args.depth_weight > 0 or not args.gate_margin > 0:
        raise SystemExit("--depth-weight and --gate-margin must be positive")
    train_max = args.train_max_loops or min(2 * cfg.default_loops, cfg.max_loops)
    if not 1 <= train_max <= cfg.max_loops:
        raise SystemExit(f"--train-max-loops must be in [1, {cfg.max_loops}]")
    if args.eval_loops:
        eval_loops = sorted({int(v) for v in args.eval_loops.split(",")})
    else:
        eval_loops = sorted({1, 2, cfg.default_loops, min(2 * cfg.default_loops, cfg.max_loops),
                             cfg.max_loops} & set(range(1, cfg.max_loops + 1)))

    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    loop_rng = np.random.default_rng([args.seed, 1])
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.set_float32_matmul_precision("high")       # TF32 for the few float32 matmuls
        torch.backends.cudnn.benchmark = False
    model = LoopedLM(cfg, max_seq_len=args.seq_len)
    if args.init_from:
        log(f"init: {init_from(model, args.init_from)}")
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    size_q4_f16 = predicted_payload_bytes(cfg, "q4", 64, "f16")
    size_q4_q8 = predicted_payload_bytes(cfg, "q4", 64, "q8")
    fwd = torch.compile(model) if args.compile else model
    amp = device.type == "cuda" and not args.no_amp

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        opt_kw["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kw)

    train_t = torch.from_numpy(train_np.astype(np.int32)).to(device)
    held_t = torch.from_numpy(held_np.astype(np.int32)).to(device)
    T, B = args.seq_len, args.batch_size
    offs = torch.arange(T + 1, device=device)

    def batch_at(data, starts_np):
        idx = torch.from_numpy(starts_np.astype(np.int64)).to(device)[:, None] + offs
        w = data[idx].long()
        return w[:, :-1], w[:, 1:]

    def loss_of(x, y, loops):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = fwd(x, loops)
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))

    def token_losses(hidden, y):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model._logits(hidden)
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1), reduction="none")

    def deep_loss_of(x, y, loops):
        """--exit-train deep: (total, {name: detached parts}). Each depth d < loops adds its
        loss with weight --depth-weight (the last depth has weight 1); with --exit-gate, the gate
        reads the detached depth-d state and learns the per-token label "the loss at d is within
        --gate-margin of the last depth's" by binary cross-entropy (the LM gets no gradient from it)."""
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            exits, top = model.depth_states(x, loops)
        last = token_losses(top, y)
        total = last.mean()
        parts = {"lm_last": total.detach()}
        gate_terms = []
        for d, (state, hidden) in enumerate(exits, 1):
            ce = token_losses(hidden, y)
            total = total + args.depth_weight * ce.mean()
            if args.exit_gate:
                label = ((ce - last).detach() < args.gate_margin).float()
                z = model.exit_gate_logit(state.detach().float()).reshape(-1)
                gate_terms.append(F.binary_cross_entropy_with_logits(z, label))
        total = total / (1.0 + args.depth_weight * len(exits))
        if gate_terms:
            gate = torch.stack(gate_terms).mean()
            parts["gate_bce"] = gate.detach()
            total = total + gate
        return total, parts

    @torch.no_grad()
    def evaluate(data, loops, max_tokens, starts=None):
        """Mean loss over non-overlapping windows (or the given window starts)."""
        model.eval()
        if starts is None:
            n_win = (data.numel() - 1) // T
            if max_tokens:
                n_win = min(n_win, max(1, max_tokens // T))
            starts = np.arange(n_win, dtype=np.int64) * T
        tot, cnt = 0.0, 0
        for i in range(0, len(starts), B):
            x, y = batch_at(data, starts[i:i + B])
            tot += float(loss_of(x, y, loops)) * y.numel()
            cnt += y.numel()
        model.train()
        return tot / max(1, cnt)

    # fixed sample of train windows, to compare with held-out (overfitting check)
    train_probe = np.random.default_rng([args.seed, 2]).integers(
        0, train_np.size - T - 1, size=max(1, args.eval_tokens // T))

    log(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
        f"torch {torch.__version__}, amp={'bf16' if amp else 'off'}")
    log(f"data: train {train_np.size:,} tokens, held-out {held_np.size:,}; vocab {vocab_size}, eos {eos_id}")
    log(f"model: {n_params:,} params; effective layers at L={cfg.default_loops}: "
        f"{cfg.n_layers(cfg.default_loops)}; predicted tensor payload q4g64+f16 embed {_mb(size_q4_f16)}, "
        f"q4g64+q8 embed {_mb(size_q4_q8)}")
    log(f"train: {args.steps} steps x {B} x {T} = {args.steps * B * T / 1e6:.1f}M tokens "
        f"({args.steps * B * T / train_np.size:.1f} epochs); L: p={args.p_default} at {cfg.default_loops}, "
        f"else uniform 1..{train_max}; time budget {args.time_budget_s or 'none'} s")

    def lr_at(step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / max(1, args.warmup))
        cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return args.lr * warm * (args.min_lr_frac + (1.0 - args.min_lr_frac) * cos)

    history, evals = [], []
    loss_acc = torch.zeros((), device=device)
    n_acc, loops_hist, tokens, part_acc = 0, {}, 0, {}
    step, stop_reason = 0, "steps"
    t_loop = time.time()
    t_last = t_loop
    while step < args.steps:
        elapsed = time.time() - t_loop
        progress = step / args.steps
        if args.time_budget_s:
            if elapsed >= args.time_budget_s:
                stop_reason = "time budget"
                break
            progress = max(progress, elapsed / args.time_budget_s)
        lr = lr_at(step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        L = sample_loops(loop_rng, cfg.default_loops, train_max, args.p_default)
        x, y = batch_at(train_t, np_rng.integers(0, train_np.size - T - 1, size=B))
        if args.exit_train == "deep":
            loss, parts = deep_loss_of(x, y, L)
            for k, v in parts.items():          # (sum, steps): L = 1 steps have no gate term
                acc = part_acc.setdefault(k, [0.0, 0])
                acc[0] += v
                acc[1] += 1
        else:
            loss = loss_of(x, y, L)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens += B * T
        loss_acc += loss.detach()
        n_acc += 1
        loops_hist[L] = loops_hist.get(L, 0) + 1
        if step % args.log_every == 0 or step == args.steps:
            mean = float(loss_acc) / n_acc
            if not math.isfinite(mean):
                log(f"step {step}: loss is {mean}; stopping without saving the model")
                stop_reason = "non-finite loss"
                break
            now = time.time()
            tps = n_acc * B * T / max(1e-9, now - t_last)
            parts = {k: round(float(v) / n, 5) for k, (v, n) in part_acc.items()}
            history.append({"step": step, "loss": round(mean, 5), "lr": lr, "time_s": round(now - t_loop, 2),
                            **parts})
            log(f"step {step:5d}  loss {mean:.4f}  lr {lr:.2e}  {tps / 1e3:8.1f}k tok/s  "
                f"elapsed {now - t_loop:6.1f}s" + "".join(f"  {k} {v:.4f}" for k, v in parts.items()))
            loss_acc.zero_()
            part_acc.clear()
            n_acc, t_last = 0, now
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            t_e = time.time()
            ev = {"step": step,
                  "heldout": round(evaluate(held_t, cfg.default_loops, args.eval_tokens), 5),
                  "train_probe": round(evaluate(train_t, cfg.default_loops, 0, train_probe), 5)}
            evals.append(ev)
            log(f"eval @ {step}: held-out {ev['heldout']:.4f}  train-probe {ev['train_probe']:.4f} "
                f"(L={cfg.default_loops}, {time.time() - t_e:.1f}s)")
            t_last += time.time() - t_e
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_loop
    if n_acc:
        history.append({"step": step, "loss": round(float(loss_acc) / n_acc, 5), "time_s": round(train_time, 2)})
    log(f"training stopped ({stop_reason}) after {step} steps, {train_time:.1f}s, {tokens / 1e6:.1f}M tokens")

    result = {"args": vars(args), "config": cfg.to_dict(), "n_params": n_params,
              "predicted_payload_bytes": {"q4g64_f16embed": size_q4_f16, "q4g64_q8embed": size_q4_q8},
              "steps": step, "stop_reason": stop_reason, "train_time_s": round(train_time, 2),
              "tokens_seen": tokens, "epochs": round(tokens / train_np.size, 3),
              "loops_histogram": {str(k): v for k, v in sorted(loops_hist.items())},
              "history": history, "periodic_evals": evals,
              "final_loss": history[-1]["loss"] if history else None,
              "device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if stop_reason == "non-finite loss":
        with open(os.path.join(args.out, "train_log.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        logf.close()
        raise SystemExit(2)

    # ---------------------------------------------------------------- final eval
    t_e = time.time()
    final = {}
    for L in eval_loops:
        final[str(L)] = round(evaluate(held_t, L, args.final_eval_tokens), 5)
        log(f"final held-out loss at L={L:2d}: {final[str(L)]:.4f} nats/token")
    result["eval_heldout_loss"] = final
    result["eval_train_probe_loss_default_L"] = round(
        evaluate(train_t, cfg.default_loops, 0, train_probe), 5)
    held_bytes = meta.get("bytes", {}).get("heldout")
    if held_bytes and not args.final_eval_tokens:
        # bits per byte: nats/token / ln 2 * tokens/byte of the held-out side (EOS ids included)
        scale = held_np.size / held_bytes
        result["eval_heldout_bits_per_byte"] = {k: round(v / math.log(2) * scale, 4) for k, v in final.items()}
    result["eval_time_s"] = round(time.time() - t_e, 2)

    # ---------------------------------------------------------------- save
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous()
               for k, v in model.state_dict_logical().items()}
    files = save_weights({k: v.numpy() for k, v in tensors.items()}, args.out,
                         {"format": "tinyloop-logical", "config": json.dumps(cfg.to_dict())},
                         int(args.max_shard_mib * (1 << 20)))
    with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=1)
        f.write("\n")
    result["weight_files"] = files
    result["total_time_s"] = round(time.time() - t_start, 2)
    with open(os.path.join(args.out, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    log(f"saved {', '.join(files)}, config.json, train_log.json to {args.out} "
        f"(total {result['total_time_s']:.1f}s)")
    logf.close()
    return result


if __name__ == "__main__":
    main()
