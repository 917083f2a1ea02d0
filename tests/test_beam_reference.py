"""Beam search (GenerateConfig.beam_size >= 2) against transformers' own beam search:
``generate(num_beams=K, do_sample=False, length_penalty=a, early_stopping="never",
max_new_tokens=N, eos_token_id=...)`` on tiny random Llama checkpoints written by
``save_pretrained`` and converted with ``convert_hf`` at f32 (fp32 KV cache), over seeded random
prompts, beam sizes 2-5, length penalties 0, 0.5, 1, 2, -0.5, -1, no / one / two EOS ids (eos_id
and extra_eos_ids) and a stop sequence. The returned sequence must be transformers' and its score
(recomputed from tl.score in float64 under TinyLoop's rule) transformers' ``sequences_scores``.

TinyLoop's definition (tinyloop/plugins/decoders/beam.py, the spec's "log_prob / max(1,
len)^length_penalty"), and where transformers (5.x, the vectorised ``_beam_search``) stands:

* Length: n = the generated tokens, prompt excluded, the ending EOS / stop-sequence token
  included (n >= 1, so the spec's max(1, len) never applies). transformers divides by
  ``cur_len + 1 - prompt_len``: the same n (releases before transformers#27351, 2023, counted
  the prompt too).
* log_prob: the float64 sum of the log-softmax of the raw logits. transformers accumulates in
  float32; the scores agree to ~1e-6 relative, and a near-tie may break either way.
* Ranking: every candidate (live beam x token) by score; among equal scores lower token id, then
  lower parent rank. transformers ranks by the accumulated log-prob (the same order: every
  candidate of one step has the same n); its ties follow torch.topk.
* A beam finishes on EOS (eos_id or any extra_eos_ids), a stop sequence over its generated
  tokens, a plugin's rule, or at max_tokens. TinyLoop finishes every ending candidate met before
  the K-th continuing one; transformers only the ending candidates ranked in the top K. The extra
  ones are ranked below an ending candidate of the same step that both keep, so the best finished
  beam, the only one returned, is the same.
* Search end: TinyLoop is exact. It stops when no live beam can beat the best finished beam, the
  live beam's bound taken at the most favourable length it can still reach (max_tokens when
  length_penalty > 0, else the next step): transformers' ``early_stopping="never"``, the setting
  matched here. transformers' default ``early_stopping=False`` bounds a live beam at its current
  length, which is exact for length_penalty <= 0 (then equal to TinyLoop) but can stop too
  early for length_penalty > 0, where a longer beam can still win; ``early_stopping=True`` stops once K
  beams have finished. Both can return a lower-scoring beam than TinyLoop
  (test_transformers_heuristic_stops_return_lower_scores pins cases).
* Output: the best finished beam (among equal scores the one that finished first), its EOS or
  stop sequence included, as transformers returns it (num_return_sequences=1).
* Stop sequences: transformers has none over token ids; they are given to it as a
  StoppingCriteria over the generated tail. transformers' candidate window is (1 + #EOS ids) * K,
  which counts no other stopping criteria, so with more ending tokens than EOS ids it can run
  short of live beams; TinyLoop widens its walk by every rule's ending-token bound. The cases here
  keep to one stop sequence without EOS, where transformers' window is wide enough.

Needs torch and transformers (the torch extra); skipped without them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402

from test_hf_import import V, _make, _save  # noqa: E402

ALPHAS = (0.0, 0.5, 1.0, 2.0, -0.5, -1.0)
#: (model seed, embedding / head scale: flat logits, so beams depart from greedy and from each other)
MODELS = ((1, 0.15), (2, 0.3))


def _lsm(x):
    x = np.asarray(x, np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def tl_score(model, prompt, gen, alpha):
    """TinyLoop's score of `gen` after `prompt`: float64 log_prob / max(1, len(gen)) ** alpha."""
    lp = _lsm(tl.score(model, list(prompt) + list(gen), cache_mode="fp32"))
    total = sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(gen))
    return total / max(1, len(gen)) ** alpha


class TailStop(transformers.StoppingCriteria):
    """A stop sequence for transformers: ends a row whose generated tokens end with one of `seqs`."""

    def __init__(self, prompt_len, seqs):
        self.prompt_len, self.seqs = prompt_len, [list(s) for s in seqs]

    def __call__(self, input_ids, scores, **kw):
        rows = [r[self.prompt_len:] for r in input_ids.tolist()]
        return torch.tensor([any(len(s) <= len(g) and g[-len(s):] == s for s in self.seqs) for g in rows])


def hf_beam(m, prompt, K, N, alpha, eos, early_stopping="never", stops=()):
    """transformers' beam search: (generated tokens, sequences_scores). The attention mask is given:
    transformers would infer one from pad_token_id and mask a prompt token equal to it."""
    crit = transformers.StoppingCriteriaList([TailStop(len(prompt), stops)]) if stops else None
    with torch.no_grad():
        o = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       num_beams=K, do_sample=False, length_penalty=alpha, early_stopping=early_stopping,
                       max_new_tokens=N, eos_token_id=list(eos) or None, pad_token_id=0,
                       stopping_criteria=crit, output_scores=True, return_dict_in_generate=True)
    return o.sequences[0].tolist()[len(prompt):], float(o.sequences_scores[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(seed, scale, variant) -> (transformers model, converted TinyLoop model, eos ids); variant 0
    has no EOS, 1 one EOS id, 2 two (eos_id and extra_eos_ids). The EOS ids are tokens the beams
    meet: those in the most of the plain model's beam outputs over the prompts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny matrices: threads only add overhead (and spin on a busy machine)
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("beam_ref")
    out = {}
    for seed, scale in MODELS:
        m = _make("llama", seed=seed)
        with torch.no_grad():
            m.model.embed_tokens.weight.mul_(scale)
            m.lm_head.weight.mul_(scale)
        src = _save(m, root / f"s{seed}")
        out[(seed, scale, "src")] = src
        ranked = []
        for variant in range(3):
            if variant == 1:
                plain = out[(seed, scale, 0)][1]
                counts = np.zeros(V, int)
                for p in _prompts(seed):
                    free = tl.generate(plain, p, tl.GenerateConfig(max_tokens=8, beam_size=3, cache_mode="fp32"))
                    counts[np.unique(free[len(p):])] += 1
                ranked = [int(t) for t in np.argsort(-counts, kind="stable")]
            eos = tuple(ranked[:variant])
            tm = _with_eos(src, str(root / f"s{seed}_v{variant}"), eos)
            out[(seed, scale, variant)] = (m, tm, eos)
    yield out
    torch.set_num_threads(threads)
    for k, v in out.items():
        if k[2] != "src":
            tl.free_model(v[1])


def _with_eos(src, d, eos):
    """The checkpoint `src` with eos_token_id = `eos` (a list: eos_id, then extra_eos_ids),
    converted at f32 and loaded on the CPU."""
    shutil.copytree(src, d)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                c = json.load(f)
            c["eos_token_id"] = list(eos) or None
            with open(path, "w") as f:
                json.dump(c, f)
    convert_hf(d, d + ".tinyloop", quant="f32")
    tm = tl.load_model(d + ".tinyloop", backend="cpu", max_seq_len=64)
    assert (tm.cfg.eos_id, tuple(tm.cfg.extra_eos_ids)) == ((eos[0], eos[1:]) if eos else (None, ()))
    return tm


def _prompts(seed, n=8):
    rng = np.random.default_rng(1000 + seed)
    return [[int(t) for t in rng.integers(0, V, int(rng.integers(1, 12)))] for _ in range(n)]


def _cases():
    """Each model x EOS variant with four of the length penalties (each penalty four times), a seeded
    prompt, beam size 2-5 and max_tokens 1-9."""
    rng = np.random.default_rng(7)
    cases, i = [], 0
    for mod in MODELS:
        for v in range(3):
            for _ in range(4):
                cases.append(dict(model=mod, eos_variant=v, alpha=ALPHAS[i % 6], prompt=int(rng.integers(0, 8)),
                                  K=int(rng.integers(2, 6)), N=int(rng.integers(1, 10))))
                i += 1
    assert {c["K"] for c in cases} == {2, 3, 4, 5}
    return cases


def _check_stats(st, gen, N, eos, stops=()):
    if gen and gen[-1] in eos:
        assert st.stop_reason == tl.StopReason.EOS
    elif any(tuple(gen[-len(s):]) == tuple(s) for s in stops if len(s) <= len(gen)):
        assert st.stop_reason == tl.StopReason.STOP_SEQUENCE
    else:
        assert st.stop_reason == tl.StopReason.MAX_TOKENS and len(gen) == N


def test_beam_equals_transformers_never_early_stopping(models):
    seen = dict(eos_won=0, short=0, not_greedy=0)
    for c in _cases():
        seed, scale = c["model"]
        m, tm, eos = models[(seed, scale, c["eos_variant"])]
        prompt = _prompts(seed)[c["prompt"]]
        K, N, alpha = c["K"], c["N"], c["alpha"]
        st = tl.GenerateStats()
        got = tl.generate(tm, prompt, tl.GenerateConfig(max_tokens=N, beam_size=K, length_penalty=alpha,
                                                        cache_mode="fp32"), stats=st)[len(prompt):]
        want, want_score = hf_beam(m, prompt, K, N, alpha, eos)
        assert got == want, c
        score = tl_score(tm, prompt, got, alpha)
        assert abs(score - want_score) <= 1e-5 * max(1.0, abs(score)), (c, score, want_score)
        _check_stats(st, got, N, eos)
        seen["eos_won"] += bool(eos) and got[-1] in eos
        seen["short"] += len(got) < N
        greedy = tl.generate(tm, prompt, tl.GenerateConfig(max_tokens=N, cache_mode="fp32"))[len(prompt):]
        seen["not_greedy"] += got != greedy
    # the grid is not vacuous: EOS beams win, beams end early and beam search departs from greedy
    assert seen["eos_won"] >= 3 and seen["short"] >= 3 and seen["not_greedy"] >= 5, seen


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, -1.0])
def test_where_the_length_penalty_decides_it_equals_transformers(models, alpha):
    """The length counted (generated tokens, EOS included, prompt not) only shows where beams of
    different lengths compete: the first two seeded EOS cases whose beam changes with the length
    penalty (TinyLoop against itself at 0) must be transformers' beam at that penalty."""
    rng = np.random.default_rng(int(alpha * 10) % 97)
    found = []
    for _ in range(200):
        mod, v = MODELS[int(rng.integers(0, 2))], int(rng.integers(1, 3))
        m, tm, eos = models[(*mod, v)]
        p = _prompts(mod[0])[int(rng.integers(0, 8))]
        K, N = int(rng.integers(2, 6)), int(rng.integers(2, 10))
        outs = [tl.generate(tm, p, tl.GenerateConfig(max_tokens=N, beam_size=K, length_penalty=a,
                                                     cache_mode="fp32"))[len(p):] for a in (alpha, 0.0)]
        if outs[0] != outs[1]:
            want, want_score = hf_beam(m, p, K, N, alpha, eos)
            assert outs[0] == want, (mod, v, p, K, N)
            assert abs(tl_score(tm, p, want, alpha) - want_score) <= 1e-5 * max(1.0, abs(want_score))
            found.append(len(want))
            if len(found) == 2:
                break
    assert len(found) == 2


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0, -1.0])
def test_stop_sequence_equals_transformers_stopping_criteria(models, alpha):
    """One stop sequence (a token or a pair the free beams emit), no EOS: the same beams."""
    seed, scale = MODELS[0]
    m, tm, _ = models[(seed, scale, 0)]
    hits = 0
    for i, p in enumerate(_prompts(seed)[:3]):
        free = tl.generate(tm, p, tl.GenerateConfig(max_tokens=5, beam_size=3, length_penalty=alpha,
                                                    cache_mode="fp32"))[len(p):]
        stop = (tuple(free[1:3]), (free[2],), (free[3],))[i]
        cfg = tl.GenerateConfig(max_tokens=7, beam_size=3, length_penalty=alpha, cache_mode="fp32",
                                stop_sequences=[list(stop)])
        st = tl.GenerateStats()
        got = tl.generate(tm, p, cfg, stats=st)[len(p):]
        want, want_score = hf_beam(m, p, 3, 7, alpha, (), stops=[stop])
        assert got == want, (p, stop)
        assert abs(tl_score(tm, p, got, alpha) - want_score) <= 1e-5 * max(1.0, abs(want_score))
        _check_stats(st, got, 7, (), [stop])
        hits += st.stop_reason == tl.StopReason.STOP_SEQUENCE
    assert hits >= 1


# (model, EOS ids, prompt, K, N, length_penalty, early_stopping): cases where transformers'
# heuristic stops return a lower-scoring beam than the exact search (found by a seeded search;
# TinyLoop equals transformers' early_stopping="never" on each)
HEURISTIC_CASES = [
    (0, (187,), [198, 226], 3, 10, 3.0, False),
    (0, (21, 104), [157, 121, 144, 139, 66, 231, 14, 4], 2, 9, 3.0, False),
    (0, (240,), [81, 282, 172, 195], 5, 8, 2.0, True),
]


def test_transformers_heuristic_stops_return_lower_scores(models, tmp_path):
    """early_stopping=False bounds a live beam at its current length, exact for length_penalty <= 0;
    for length_penalty > 0 it, and early_stopping=True always, may stop while a longer beam can
    still win. TinyLoop's beam equals early_stopping="never"'s and scores strictly higher here."""
    for i, (mk, eos, p, K, N, alpha, es) in enumerate(HEURISTIC_CASES):
        seed, scale = MODELS[mk]
        m = models[(seed, scale, 0)][0]
        tm = _with_eos(models[(seed, scale, "src")], str(tmp_path / f"h{i}"), eos)
        try:
            got = tl.generate(tm, p, tl.GenerateConfig(max_tokens=N, beam_size=K, length_penalty=alpha,
                                                       cache_mode="fp32"))[len(p):]
            assert got == hf_beam(m, p, K, N, alpha, eos)[0]
            heur, _ = hf_beam(m, p, K, N, alpha, eos, early_stopping=es)
            assert heur != got and len(heur) < len(got) and heur[-1] in eos
            assert tl_score(tm, p, got, alpha) > tl_score(tm, p, heur, alpha) + 1e-3, i
        finally:
            tl.free_model(tm)
