"""Pure helpers of the GPU bench scripts, checked without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tinyloop.model.arch import ModelConfig


def _load(name):
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BLOCK = ["qkv", "attn", "wo", "gate_up", "down"]


def _step(n_blocks, us=None):
    names = ["embed"] + BLOCK * n_blocks + ["head", "argmax", "position"]
    return [(n, float(i) if us is None else us(i, n)) for i, n in enumerate(names)]


def test_block_labels_follow_the_layer_order():
    pd = _load("profile_decode")
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64,
                      n_pre=2, n_loop=2, n_post=1, default_loops=2, max_loops=4)
    assert pd.block_labels(cfg, 2) == ["pre0", "pre1", "loop0.0", "loop0.1", "loop1.0", "loop1.1",
                                       "post0"]


def test_split_blocks_finds_the_repeated_block():
    pd = _load("profile_decode")
    names = [n for n, _ in _step(10)]
    assert pd.split_blocks(names, 10) == (1, 5)
    assert pd.split_blocks(names, 9) is None            # 10 blocks are not 9 equal ones
    assert pd.split_blocks(["a", "b"], 0) is None


def test_per_block_means_over_steps():
    pd = _load("profile_decode")
    labels = [f"b{i}" for i in range(3)]
    # step s: kernel i takes i + 10 s us; the mean over steps 0 and 1 is i + 5
    steps = [_step(3, lambda i, n, s=s: i + 10.0 * s) for s in range(2)]
    got = pd.per_block(steps, labels)
    assert got["lead"] == 1 and got["kb"] == 5
    assert [b["block"] for b in got["blocks"]] == labels
    assert got["blocks"][0]["kernels_us"] == pytest.approx([1 + 5, 2 + 5, 3 + 5, 4 + 5, 5 + 5])
    assert got["blocks"][2]["us"] == pytest.approx(sum(i + 5 for i in range(11, 16)))
    assert pd.per_block(steps[:1] + [steps[1][:-1]], labels) is None      # ragged steps
    assert pd.per_block([], labels) is None


# --------------------------------------------------------------------------- INT4 torch baseline math
def test_bf16_round_nearest_even():
    import numpy as np
    q4 = _load("torch_int4")
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5, 0.0, 3e-7], np.float32)
    got = q4.bf16_round(x)
    assert got.tolist() == [1.0, 1.0, 1 + 2 ** -6, 1 + 2 ** -7, -2.5, 0.0, got[6]]
    # a bf16 value keeps 7 fraction bits: the low 16 bits of its float32 pattern are zero
    assert (got.view(np.uint32) & 0xFFFF == 0).all()
    assert abs(got[6] - 3e-7) <= 3e-7 * 2 ** -8


def test_group_quantize_tinygemm_convention():
    import numpy as np
    q4 = _load("torch_int4")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 256)).astype(np.float32) * 0.02
    codes, s, z = q4.group_quantize(w, 128)
    assert codes.dtype == np.uint8 and codes.shape == (24, 256) and codes.max() <= 15
    assert s.shape == z.shape == (24, 2)
    assert (q4.bf16_round(s) == s).all() and (q4.bf16_round(z) == z).all()     # exact in bf16
    g = w.reshape(24, 2, 128)
    lo, hi = g.min(-1), g.max(-1)
    np.testing.assert_allclose(s, (hi - lo) / 15, rtol=2 ** -8)
    np.testing.assert_allclose(z, lo + 8 * s, rtol=2 ** -8, atol=1e-9)
    deq = q4.dequantize(codes, s, z)
    # (q - 8) * scale + zero by hand, group by group
    n, j = 5, 200
    assert deq[n, j] == (float(codes[n, j]) - 8) * s[n, 1] + z[n, 1]
    # nearest code for the stored (bf16) parameters: within half a step, plus the edge slack that
    # bf16 rounding of scale and zero leaves at the ends of the range
    err = np.abs(deq - w).reshape(24, 2, 128).max(-1)
    assert (err <= 0.5 * s + 16 * s * 2 ** -8 + np.abs(z) * 2 ** -8).all()
    x = rng.standard_normal((4, 256)).astype(np.float32)
    assert q4.rel_err(x @ deq.T, x @ w.T) < q4.MAX_REL_ERR_LOGICAL     # 4-bit noise of random weights


def test_group_quantize_on_tinyloop_grid_keeps_its_codes():
    # the bench quantizes tinyloop's dequantized INT4 weights again for torch, on the file's own
    # grid: tinyloop's codes come back, the values move by the bf16 rounding of scale and zero only
    import numpy as np
    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import dequantize, quantize, unpack
    q4 = _load("torch_int4")
    rng = np.random.default_rng(2)
    tq = TensorQuant("q4", 128)
    parts = quantize(rng.standard_normal((16, 384)).astype(np.float32) * 0.02, tq)
    w = dequantize(parts, tq, (16, 384))
    codes, s, z = q4.group_quantize(w, 128, q4.tinyloop_grid(parts["scales"], parts["zeros"]))
    assert (codes == unpack(parts["q"], 4, 384)).all()
    step = parts["scales"].astype(np.float32)
    err = np.abs(q4.dequantize(codes, s, z) - w).reshape(16, 3, 128).max(-1)
    assert (err <= 0.05 * step).all()
    # a min/max grid is another grid where a group leaves its top code unused: up to half a step
    c2, s2, z2 = q4.group_quantize(w)
    assert np.abs(q4.dequantize(c2, s2, z2) - w).max() <= 0.55 * step.max()


def test_pack_nibbles_and_scales_and_zeros_layout():
    import numpy as np
    q4 = _load("torch_int4")
    codes = np.array([[1, 2, 3, 4], [15, 0, 9, 10]], np.uint8)
    assert q4.pack_nibbles(codes).tolist() == [[0x12, 0x34], [0xF0, 0x9A]]   # element 2j high
    s = np.arange(6, dtype=np.float32).reshape(2, 3)            # (N = 2, K / group = 3)
    z = -s
    sz = q4.scales_and_zeros(s, z)
    assert sz.shape == (3, 2, 2) and sz.flags.c_contiguous
    assert sz[2, 1, 0] == s[1, 2] and sz[2, 1, 1] == z[1, 2]
    with pytest.raises(ValueError):
        q4.group_quantize(np.zeros((4, 100), np.float32))


def test_strongest_torch_is_the_fastest_measured_row():
    db = _load("decode_bench")
    res = {"torch": {"eager_decode_ms_per_token": 7.0, "graph_decode_ms_per_token": 1.4,
                     "graph_fused_decode_ms_per_token": 1.3, "compiled_graph_decode_ms_per_token": 0.66},
           "torch_int4": {"graph_decode_ms_per_token": 0.9, "compiled_graph_decode_ms_per_token": 0.48}}
    best = db.strongest_torch(res)
    assert best == {"name": "PyTorch INT4 weight-only (tinygemm) bf16 torch.compile + CUDA graph",
                    "key": "torch_int4.compiled_graph_decode_ms_per_token", "ms_per_token": 0.48}
    res["torch_int4"] = {"error": "RuntimeError: int4 matmul check failed"}      # a failed row drops out
    assert db.strongest_torch(res)["key"] == "torch.compiled_graph_decode_ms_per_token"
    assert [r[2] for r in db.torch_rows(res)][:3] == ["torch fp16 eager", "torch fp16 CUDA graph",
                                                      "  fused q|k|v, gate|up"]
    assert db.strongest_torch({}) is None


def test_bf16_round_matches_torch():
    torch = pytest.importorskip("torch")
    import numpy as np
    q4 = _load("torch_int4")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(10000) * 10.0 ** rng.integers(-6, 3, 10000)).astype(np.float32)
    ties = (np.float32(1) + np.arange(1, 64, 2, dtype=np.float32) * np.float32(2 ** -8))
    x = np.concatenate([x, ties, -ties])
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert (q4.bf16_round(x) == want).all()
    codes, s, z = q4.group_quantize(rng.standard_normal((8, 256)).astype(np.float32))
    sz = q4.scales_and_zeros(s, z)
    assert (torch.from_numpy(sz).to(torch.bfloat16).float().numpy() == sz).all()   # survives the cast


def test_int4_linear_matches_the_dequantized_matrix_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("tinygemm's _weight_int4pack_mm runs on CUDA")
    import numpy as np
    q4 = _load("torch_int4")
    rng = np.random.default_rng(4)
    w = rng.standard_normal((256, 512)).astype(np.float32) * 0.02
    codes, s, z = q4.group_quantize(w)
    x = torch.randn(4, 512).to(torch.bfloat16)
    y = q4.int4_linear(x.cuda(), q4.to_tinygemm(codes, s, z)).float().cpu().numpy()
    assert q4.rel_err(y, x.float().numpy() @ q4.dequantize(codes, s, z).T) < 1e-2


def test_ops_attention_matches_sdpa():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    q4 = _load("torch_int4")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, 16, generator=g)
    ck, cv = torch.randn(1, 4, 24, 16, generator=g), torch.randn(1, 4, 24, 16, generator=g)
    mask = (torch.arange(24) <= 9).view(1, 1, 1, 24)
    want = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(q4.ops_attention(q, ck, cv, mask, 0.25), want, rtol=1e-5, atol=1e-5)


def test_early_exit_bench_runs_and_writes_its_table_json_and_plot(tmp_path, monkeypatch):
    """bench/early_exit_bench.py end to end on the CPU at toy sizes: one fixed depth and every
    criterion the demo model can run (gate needs a learned exit gate: skipped, as is a criterion
    --criteria leaves out); the JSON rows and the PNG are written, the table prints."""
    from bench import early_exit_bench as eb
    monkeypatch.setattr(eb, "SWEEPS", [(c, f, v[:1]) for c, f, v in eb.SWEEPS])
    js, png = tmp_path / "ee.json", tmp_path / "ee.png"
    assert eb.main(["--windows", "1", "--window", "16", "--new", "4", "--repeats", "1", "--kv", "copy_last",
                    "--fixed", "3,4", "--json", str(js), "--plot", str(png)]) == 0
    import json
    res = json.loads(js.read_text())
    kinds = [(r["kind"], r.get("criterion")) for r in res["rows"]]
    assert kinds == [("fixed", None), ("fixed", None)] + [("exit", c) for c, _, _ in eb.SWEEPS if c != "gate"]
    assert all(1 <= r["mean_loops"] <= 4 and r["ppl"] > 1 for r in res["rows"])
    assert png.stat().st_size > 1000
    assert eb.main(["--windows", "1", "--window", "16", "--new", "4", "--repeats", "1", "--kv", "copy_last",
                    "--fixed", "4", "--criteria", "kl", "--json", str(js)]) == 0
    assert [r.get("criterion") for r in json.loads(js.read_text())["rows"]] == [None, "kl"]


@pytest.mark.parametrize("argv", [["--layouts", "flat,bogus"], ["--layouts", ","], ["--new", "1"],
                                  ["--repeats", "0"], ["--profile-tokens", "-1"]])
def test_guarded_overhead_refuses_bad_arguments_before_any_work(argv, capsys):
    """bench/guarded_overhead.py checks its arguments before it looks for a GPU or loads a model."""
    from bench import guarded_overhead
    with pytest.raises(SystemExit) as e:
        guarded_overhead.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert argv[0] in err and ("unknown" in err or "must be at least" in err)


@pytest.mark.parametrize("argv", [["--vocab", "0"], ["--vocab", "a,b"], ["--top-k", "2048"], ["--top-p", "0"],
                                  ["--reps", "0"], ["--scale", "-1"], ["--baseline", "/nonexistent/sample.py"]])
def test_sample_bench_refuses_bad_arguments_before_any_work(argv, capsys):
    """bench/sample_bench.py checks its arguments before it looks for a GPU."""
    from bench import sample_bench
    with pytest.raises(SystemExit) as e:
        sample_bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert argv[0] in err
