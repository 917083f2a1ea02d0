"""Chain self-speculative decoding (greedy, exact): draft draft_ahead tokens at draft_loops,
verify them in one forward at verify_loops, keep the longest prefix the verify pass agrees with and
its bonus token. The session (tinyloop.core.speculative.SpeculativeSession) owns the forwards;
this plugin owns the acceptance rule and the statistics."""

from __future__ import annotations

from ...core.decoding import Decoder
from ...core.hookspecs import hookimpl


class ChainSpeculativeDecoder(Decoder):
    name = "speculative"
    contexts = frozenset({"speculative"})

    def decode(self, session):
        spec = self.config
        session.start()
        pending = session.greedy()                 # the verify-depth token after the prompt
        yield pending
        while True:
            drafts = []
            tok = pending
            for k in range(spec.draft_ahead):
                tok = session.draft(tok, k)
                drafts.append(tok)
            verified = session.verify([pending] + drafts)
            n = 0
            while n < len(drafts) and drafts[n] == verified[n]:
                n += 1
            session.commit(n)
            bonus = verified[n]
            for t in drafts[:n]:
                yield t
            yield bonus
            pending = bonus


@hookimpl
def tinyloop_decoders():
    return [ChainSpeculativeDecoder]
