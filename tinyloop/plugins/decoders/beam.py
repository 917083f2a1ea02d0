"""Deterministic beam search (GenerateConfig.beam_size >= 2), over the session's lanes.

Scores. A beam's log_prob is the float64 sum, over its generated tokens, of the log-softmax of the
logits at the request's loop depth (``z = x - max(x); lp = z - log(sum(exp(z)))``, a NaN logit
counted as -inf); its score is ``log_prob / max(1, n) ** length_penalty`` with n its generated tokens.

Step n. Every live beam is expanded by every token. Candidates rank by score (higher first), then
lower token id, then lower parent index (a parent's index is its rank among the live beams). The
ranking is walked in order: a candidate that one of the request's stop rules ends
(session.stoppers: EOS, a stop sequence over the generated tokens, a plugin's own rule) finishes
and keeps its score; a candidate reaching max_tokens finishes too; the others become the next live
beams, until beam_size are live. The rest of the ranking is dropped. Each beam checks its own clone
of the stop rules, so a rule that keeps state follows each sequence.

Stop. The search ends when no beam is live (max_tokens included), or when beam_size beams have
finished and no live beam can beat the best finished one: log_prob never rises, so a live beam's
final score is at most ``log_prob / max(1, n') ** length_penalty`` at the most favourable length n'
it can still end at (max_tokens when length_penalty > 0, else n + 1). This early stop never changes
the result.

Output. The finished beam with the best score (among equal scores, the one that finished first),
yielded token by token after the search, so the engine's stop rules (the same ones, and the
consumer's callback) end the stream exactly at its last token.

Lanes. One lane (KV cache) per live beam, allocated up front with ``fork_pool``: beam_size
lanes, or fewer when the vocabulary allows fewer live beams (at most V ** (max_tokens - 1)). A
parent's first child advances in the parent's lane; further children are copied into lanes whose
beams died (``copy_state``), all copies before any advance.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ...runtime.config import StopReason
from ...runtime.decoding import Decoder
from ...errors import IncompatibleModesError
from ...runtime.hookspecs import hookimpl

BEAM_COMPAT = {"single": "ok", "batched": "rejected", "speculative": "rejected", "tree_speculative": "rejected",
               "prefix_reuse": "rejected", "warm_start": "rejected"}


def log_softmax(logits) -> np.ndarray:
    """Float64 log-softmax of one logits row (the formula of the module docstring). A NaN logit
    counts as -inf; when the largest logit is not finite (+inf, or every logit -inf) the largest
    ones share the probability equally."""
    x = np.array(logits, np.float64)
    x[np.isnan(x)] = -np.inf
    mx = x.max()
    if not np.isfinite(mx):
        top = x == mx
        return np.where(top, -np.log(top.sum()), -np.inf)
    z = x - mx
    return z - np.log(np.exp(z).sum())


def top_tokens(scores: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m best entries of `scores`, ordered by (score descending, id ascending)."""
    V = scores.shape[0]
    if m < V:
        kth = np.partition(scores, V - m)[V - m]
        idx = np.flatnonzero(scores >= kth)
    else:
        idx = np.arange(V)
    return idx[np.lexsort((idx, -scores[idx]))][:m]


class _Beam:
    __slots__ = ("tokens", "logprob", "lane", "stops")

    def __init__(self, tokens: Tuple[int, ...], logprob: float, lane: int, stops):
        self.tokens, self.logprob, self.lane, self.stops = tokens, logprob, lane, stops


class BeamSearchDecoder(Decoder):
    name = "beam"
    mode = "beam_search"
    compat = BEAM_COMPAT
    contexts = frozenset({"single"})
    honours = frozenset({"beam_size", "length_penalty"})
    applies_processors = False          # processors are per sequence: the beams would share one
    emits_after_search = True           # every token comes out after the search

    @classmethod
    def matches(cls, config) -> bool:
        return config.beam_size >= 2

    @classmethod
    def validate(cls, model, config, options) -> None:
        if config.beam_size < 2:
            raise IncompatibleModesError(f"beam_size={config.beam_size} asks for ordinary decoding (0 or 1), but "
                                         f"decoder 'beam' was chosen; beam search needs beam_size >= 2")

    def decode(self, session):
        c = self.config
        K = max(1, c.beam_size)
        N = c.max_tokens
        alpha = c.length_penalty
        stops = session.stoppers
        # per beam, the walk takes at most K continuing candidates plus the ending ones before them
        # (every token when a stop rule gives no bound on how many tokens can end a sequence)
        bound = stops.ending_tokens
        m = session.vocab_size if bound is None else K + bound
        # a lane per beam that can be live: after step n at most min(K, V ** n), and beams live
        # after steps 1 .. N - 1 only (beam_size beyond what the vocabulary allows holds no cache)
        lanes = 1
        for _ in range(N - 1):
            lanes = min(K, lanes * session.vocab_size)
            if lanes == K:
                break
        session.fork_pool(lanes)
        session.start()
        live: List[_Beam] = [_Beam((), 0.0, 0, stops.clone())]
        rows = [log_softmax(session.logits(0))]
        finished: List[Tuple[float, Tuple[int, ...]]] = []      # (score, tokens), in finishing order
        n = 0
        while live:
            n += 1
            d = float(max(1, n)) ** alpha
            cands = []
            for b, (beam, lp) in enumerate(zip(live, rows)):
                total = beam.logprob + lp
                scores = total / d
                for t in top_tokens(scores, m):
                    cands.append((-float(scores[t]), int(t), b, float(total[t])))
            cands.sort()                            # score desc, token asc, parent asc
            nxt: List[Tuple[_Beam, int]] = []       # (continuing beam, parent index)
            kept = 0
            for neg_score, t, b, total in cands:
                toks = live[b].tokens + (t,)
                rules = live[b].stops.clone()
                reason = rules.check(toks)
                if reason is not None and reason != StopReason.MAX_TOKENS:
                    finished.append((-neg_score, toks))
                    continue
                kept += 1
                if reason is not None or n >= N:    # ends by max_tokens
                    finished.append((-neg_score, toks))
                else:
                    nxt.append((_Beam(toks, total, -1, rules), b))
                if kept == K:
                    break
            if not nxt:
                break
            if len(finished) >= K:
                best = max(score for score, _ in finished)
                reach = float(max(1, N if alpha > 0 else n + 1)) ** alpha
                if max(beam.logprob for beam, _ in nxt) / reach <= best:
                    break
            # lanes: a parent's first child stays in its lane, the others take lanes of dead beams
            taken = set()
            copies = []
            for beam, b in nxt:
                lane = live[b].lane
                if lane in taken:
                    copies.append((beam, lane))
                else:
                    taken.add(lane)
                    beam.lane = lane
            free = [i for i in range(session.lanes) if i not in taken]
            for (beam, src), dst in zip(copies, free):
                session.copy_state(dst, src)
                beam.lane = dst
            live, rows = [], []
            for beam, _ in nxt:
                session.advance(beam.tokens[-1], beam.lane)
                rows.append(log_softmax(session.logits(beam.lane)))
                live.append(beam)
        session.stats.beams_finished = len(finished)
        best = min(range(len(finished)), key=lambda i: (-finished[i][0], i))
        yield from finished[best][1]


@hookimpl
def tinyloop_decoders():
    return [BeamSearchDecoder]
