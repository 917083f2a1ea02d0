"""Tree self-speculative decoding: exact greedy tokens for every K_branches, tree depth, draft depth
and verify-resume setting; the draft tree's tables; tree sampling's distribution; statistics;
typed errors before work."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop import SpeculativeConfig, TreeSpeculativeConfig
from tinyloop.plugins.decoders.spec_session import DraftTree, tree_nodes

from conftest import write_tiny
from test_speculative import _chi2, _chi2_critical, _exact_marginals


@pytest.fixture(scope="module")
def model(spec_model):
    return spec_model


def test_draft_tree_tables():
    t = DraftTree(3, 2)
    assert t.n_nodes == tree_nodes(3, 2) == 13
    assert list(t.level(1)) == [1, 2, 3] and list(t.level(2)) == list(range(4, 13))
    assert list(t.children(0)) == [1, 2, 3] and list(t.children(2)) == [7, 8, 9]
    assert list(t.children(9)) == []
    assert list(t.depth) == [0, 1, 1, 1] + [2] * 9
    assert list(t.path[8]) == [0, 2, 8] and list(t.path[2][:2]) == [0, 2] and t.path[0][0] == 0
    chain = DraftTree(1, 4)   # K = 1 is the chain: node i at depth i, path 0..i
    assert chain.n_nodes == 5 and [list(chain.path[i][:i + 1]) for i in range(5)] == [list(range(i + 1))
                                                                                      for i in range(5)]


@pytest.mark.parametrize("verify_loops", [3, 6])
@pytest.mark.parametrize("resume", [True, False])
def test_exact_greedy_for_every_tree(model, prompt, verify_loops, resume):
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=24, loops=verify_loops))
    for K in (1, 2, 3, 4):
        for D in (1, 2, 3):
            for draft_loops in sorted({1, verify_loops // 2, verify_loops - 1}):
                cfg = TreeSpeculativeConfig(max_tokens=24, draft_loops=draft_loops, verify_loops=verify_loops,
                                            draft_ahead=D, K_branches=K, verify_resume=resume)
                assert tl.generate_tree_speculative(model, prompt, cfg) == ref, (K, D, draft_loops)


def test_weak_draft_takes_branches(tmp_path):
    """A draft at one loop of a model whose depth matters disagrees with the verify depth often; the
    second and later branches must then be accepted sometimes, and the output stays exact."""
    path = tmp_path / "m.tinyloop"
    write_tiny(path, seed=7, quant="q8", group_size=32)
    m = tl.load_model(str(path), max_seq_len=200, backend="cpu")
    try:
        hits = 0
        for p in ([4, 9, 1], [30, 31, 32, 33], [7] * 6, [90, 3, 55, 8, 1]):
            ref = tl.generate(m, p, tl.GenerateConfig(max_tokens=40, loops=8))
            chain, tree = tl.GenerateStats(), tl.GenerateStats()
            tl.generate_speculative(m, p, SpeculativeConfig(max_tokens=40, draft_loops=1, verify_loops=8,
                                                            draft_ahead=3), stats=chain)
            out = tl.generate_tree_speculative(m, p, TreeSpeculativeConfig(
                max_tokens=40, draft_loops=1, verify_loops=8, draft_ahead=3, K_branches=3), stats=tree)
            assert out == ref
            hits += tree.mean_accepted_length > chain.mean_accepted_length
        assert hits >= 1
    finally:
        tl.free_model(m)


def test_fp32_cache_short_outputs_and_stop_sequence(model, prompt):
    for n in (0, 1, 2, 7):
        ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=n, loops=4, cache_mode="fp32"))
        assert tl.generate_tree_speculative(model, prompt, TreeSpeculativeConfig(
            max_tokens=n, draft_loops=2, verify_loops=4, draft_ahead=2, K_branches=3, cache_mode="fp32")) == ref
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, loops=4))[len(prompt):]
    stop = ref[5:7]
    first = next(i for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
    out = tl.generate_tree_speculative(model, prompt, TreeSpeculativeConfig(
        max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=3, K_branches=2, stop_sequences=[stop]))
    assert out[len(prompt):] == ref[:first + 2]


def test_stats(model, prompt):
    st = tl.GenerateStats()
    cfg = TreeSpeculativeConfig(max_tokens=30, draft_loops=2, verify_loops=5, draft_ahead=3, K_branches=2)
    out = tl.generate_tree_speculative(model, prompt, cfg, stats=st)
    assert st.tokens_emitted == len(out) - len(prompt) == 30
    assert st.verify_forwards >= 1
    assert st.drafted_tokens == (tree_nodes(2, 3) - 1) * st.verify_forwards   # every node but the root
    assert 0 <= st.accepted_tokens <= 3 * st.verify_forwards
    assert 1.0 <= st.mean_accepted_length <= 4.0
    assert st.full_depth_forwards_saved == st.tokens_emitted - 1 - st.verify_forwards
    # per cycle: 3 draft levels at 2 loops, then the verify (2 loops for the leaves + 3 resumed)
    assert st.loop_iters_run >= 5 + st.verify_forwards * (3 * 2 + 5)


def test_demo_model_exact_over_many_prompts():
    from tinyloop.models import demo_model_path
    from tinyloop.model.tokenizer import resolve_tokenizer
    m = tl.load_model(demo_model_path(), max_seq_len=256, backend="cpu")
    try:
        tok = resolve_tokenizer(m.header.tokenizer, None, m.vocab_size)
        texts = ("def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n",
                 "for i in range(10):\n    ", "    return self._", "if __name__ == '__main__':\n")
        for text in texts:
            ids = tok.encode(text)
            ref = tl.generate(m, ids, tl.GenerateConfig(max_tokens=32, loops=4))
            for K, D, Ld in ((1, 4, 2), (2, 2, 2), (3, 3, 1), (4, 2, 3)):
                st = tl.GenerateStats()
                out = tl.generate_tree_speculative(m, ids, TreeSpeculativeConfig(
                    max_tokens=32, draft_loops=Ld, verify_loops=4, draft_ahead=D, K_branches=K), stats=st)
                assert out == ref, (text, K, D, Ld)
                assert st.mean_accepted_length > 1.0
    finally:
        tl.free_model(m)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(K_branches=0), tl.ConfigError, "K_branches=0"),
    (dict(draft_loops=4), tl.ConfigError, r"draft_loops=4 is outside the allowed range \[1, 3\]"),
    (dict(verify_loops=9), tl.ConfigError, "verify_loops=9"),
    (dict(K_branches=4, draft_ahead=5), tl.ConfigError, "draft tree of 1365 nodes"),
    (dict(temperature=0.9, top_k=0), tl.ConfigError, "top_k=0"),
    (dict(cache_mode="int3"), tl.PluginError, "cache_mode=.int3. is not registered"),
])
def test_errors_before_work(model, prompt, monkeypatch, kw, exc, match):
    calls = []
    monkeypatch.setattr(model.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(exc, match=match):
        tl.generate_tree_speculative(model, prompt, TreeSpeculativeConfig(**{"verify_loops": 4, **kw}))
    with pytest.raises(tl.ConfigError, match="takes a SpeculativeConfig, got TreeSpeculativeConfig"):
        tl.generate_speculative(model, prompt, TreeSpeculativeConfig(verify_loops=4))
    with pytest.raises(tl.ConfigError, match="takes a TreeSpeculativeConfig"):
        tl.generate_tree_speculative(model, prompt, SpeculativeConfig(verify_loops=4))
    assert calls == []


def test_tree_sampling_deterministic_per_seed(model, prompt):
    def run(seed):
        return tl.generate_tree_speculative(model, prompt, TreeSpeculativeConfig(
            max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=2, K_branches=3, temperature=0.8, seed=seed))
    a = run(5)
    assert a == run(5) and len(a) == len(prompt) + 20
    assert len({tuple(run(s)) for s in range(4)}) > 1


@pytest.mark.slow
def test_tree_sampling_matches_plain_sampling_distribution(tmp_path):
    """Chi-square: tokens 2 and 3 of tree speculative sampling (K = 3 candidates, depth 2, drafted at
    L=1, verified at L=4) follow the exact distribution of plain sampling at L=4 (enumerated)."""
    path = tmp_path / "v16.tinyloop"
    write_tiny(path, seed=4, vocab_size=16, d_model=32, d_ff=64)
    m = tl.load_model(str(path), max_seq_len=48, backend="cpu")
    try:
        prompt = [1, 5, 9]
        T, K, P = 1.3, 8, 0.9
        p1, p2 = _exact_marginals(m, prompt, 4, T, K, P)
        c1, c2 = np.zeros(16), np.zeros(16)
        st = tl.GenerateStats()
        for seed in range(1500):
            cfg = TreeSpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=4, draft_ahead=2, K_branches=3,
                                        temperature=T, top_k=K, top_p=P, seed=seed)
            out = tl.generate_tree_speculative(m, prompt, cfg, stats=st)[len(prompt):]
            c1[out[1]] += 1
            c2[out[2]] += 1
        for counts, probs in ((c1, p1), (c2, p2)):
            stat, df = _chi2(counts, probs)
            assert stat < _chi2_critical(df), (stat, df)
    finally:
        tl.free_model(m)
