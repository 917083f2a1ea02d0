"""Chain self-speculative decoding: draft draft_ahead tokens at draft_loops, verify them in one
forward at verify_loops. The session (spec_session.SpeculativeSession) owns the forwards; this
plugin owns the acceptance rule. Options: spec_session.SpeculativeOptions (draft_loops,
verify_loops, draft_ahead, verify_resume).

Greedy (temperature <= 0.01): keep the longest prefix of drafts the verify pass's argmax agrees with,
plus the verify pass's next token; exactly the tokens of plain greedy decoding at verify_loops.

Sampling (speculative sampling, Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"): drafts are sampled from q (the draft depth's sampling distribution after
temperature / top-k / top-p); draft k is accepted with probability min(1, p_k(d) / q_k(d)) where p_k
is the verify depth's distribution; at the first rejection the token is drawn from
normalise(max(0, p_k - q_k)); if every draft is accepted a bonus token is drawn from p_K. Each emitted
token is then distributed exactly as plain sampling at verify_loops.
"""

from __future__ import annotations

import numpy as np

from ...runtime.decoding import SAMPLING_FIELDS, Decoder
from ...runtime.hookspecs import hookimpl
from ...runtime.sampling import draw, sampling_probs, uniform
from . import spec_session
from .spec_session import SpeculativeOptions, SpeculativeSession


class ChainSpeculativeDecoder(Decoder):
    name = "speculative"
    contexts = frozenset({"single"})
    compat_context = "speculative"
    options_class = SpeculativeOptions
    session_class = SpeculativeSession
    honours = SAMPLING_FIELDS
    applies_processors = False          # drafts and verify rows are read off the device

    @classmethod
    def honoured(cls, config):
        # top_k / top_p / sample_seed shape speculative sampling only
        return super().honoured(config) if config.sampling else super().honoured(config) - SAMPLING_FIELDS

    @classmethod
    def validate(cls, model, config, options):
        spec_session.validate(model, config, options)

    @classmethod
    def depth(cls, config, options):
        return spec_session.verify_depth(config, options)

    def decode(self, session):
        if self.config.sampling:
            yield from self._sample(session)
            return
        session.start()
        pending = session.greedy()                 # the verify-depth token after the prompt
        yield pending
        while True:
            # ahead: the commit below follows the greedy rule, so the next cycle may be queued first
            drafts, verified = session.draft_cycle(pending, self.options.draft_ahead, ahead=True)
            n = 0
            while n < len(drafts) and drafts[n] == verified[n]:
                n += 1
            session.commit(n)
            bonus = verified[n]
            for t in drafts[:n]:
                yield t
            yield bonus
            pending = bonus


    def _sample(self, session):
        c = self.config
        rng = np.random.Generator(np.random.PCG64(c.sample_seed))

        def probs(logits):
            return sampling_probs(logits, c.temperature, c.top_k, c.top_p)
        session.start()
        pending = draw(probs(session.logits()), uniform(rng))
        yield pending
        while True:
            drafts, qs = [], []
            tok = pending
            for k in range(self.options.draft_ahead):
                session.draft(tok, k)
                q = probs(session.logits())
                tok = draw(q, uniform(rng))
                drafts.append(tok)
                qs.append(q)
            session.verify([pending] + drafts)
            rows = session.verify_logits(len(drafts) + 1)
            out = []
            for k, (d, q) in enumerate(zip(drafts, qs)):
                p = probs(rows[k])
                if uniform(rng) * q[d] <= p[d]:        # accept with probability min(1, p/q)
                    out.append(d)
                    continue
                residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                out.append(draw(residual / total if total > 0 else p, uniform(rng)))
                break
            else:
                out.append(draw(probs(rows[len(drafts)]), uniform(rng)))
            session.commit(len(out) - 1)
            yield from out
            pending = out[-1]


@hookimpl
def tinyloop_decoders():
    return [ChainSpeculativeDecoder]
