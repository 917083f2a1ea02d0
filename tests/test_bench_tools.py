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
