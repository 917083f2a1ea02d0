"""Tree self-speculative decoding: every draft step keeps the K_branches most likely tokens of each
node (a full K-ary tree of depth draft_ahead, drafted level by level at draft_loops), one
tree-masked forward at verify_loops scores every node, and the longest path the verify pass agrees
with is committed. The session (spec_session.TreeSpeculativeSession) owns the forwards; this
plugin owns the acceptance rule. Options: spec_session.TreeSpeculativeOptions (those of the chain
decoder and K_branches).

Greedy (temperature <= 0.01): from the root, follow the child whose token equals the verify
argmax after the current node; emit the accepted tokens and then the verify argmax after the last
accepted node (the bonus token). Exactly the tokens of plain greedy decoding at verify_loops.

Sampling: the children of a node are deterministic candidates (the draft's top-K), so the rule is
sequential rejection without replacement. With p the verify depth's sampling distribution after
the node (temperature / top-k / top-p) and r = p: for each child c in order, accept c with
probability r(c) / sum(r), else set r(c) = 0 and go on; if every child is rejected, draw the token
from r / sum(r) and stop. An accepted child becomes the current node (its own children are tried
against its verify row); a leaf ends the walk with a draw from its row. Telescoping the products
shows each emitted token is distributed exactly as p: plain sampling at verify_loops.

On a backend without the ``tree`` capability (tinyloop.runtime.backend.TreeOps) the request is handed
to the chain decoder with the same options less K_branches: the one-branch tree, whose tokens are
the same (greedy) or distributed the same (sampling).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...runtime.hookspecs import hookimpl
from ...runtime.sampling import draw, sampling_probs, uniform
from .spec_session import TreeSpeculativeOptions, TreeSpeculativeSession
from .speculative import ChainSpeculativeDecoder


class TreeSpeculativeDecoder(ChainSpeculativeDecoder):
    name = "tree_speculative"
    compat_context = "tree_speculative"
    options_class = TreeSpeculativeOptions
    session_class = TreeSpeculativeSession

    @classmethod
    def resolve(cls, model, config, context):
        if model.backend.supports("tree"):
            return None
        raw = config.options
        options = dataclasses.asdict(raw) if dataclasses.is_dataclass(raw) else dict(raw or {})
        options.pop("K_branches", None)
        return dataclasses.replace(config, decoder=ChainSpeculativeDecoder.name, options=options)

    def decode(self, session):
        c = self.config
        sampling = c.sampling
        rng = np.random.Generator(np.random.PCG64(c.sample_seed))

        def probs(logits):
            return sampling_probs(logits, c.temperature, c.top_k, c.top_p)
        tree = session.tree
        session.start()
        pending = draw(probs(session.logits()), uniform(rng)) if sampling else session.greedy()
        yield pending
        while True:
            # ahead (greedy): the walk below is the greedy rule, so the next cycle may be queued first
            tokens, verified = session.tree_cycle(pending, ahead=not sampling)
            if sampling:
                path, last = self._walk_sampled(tree, tokens, session.verify_logits(tree.n_nodes), probs, rng)
            else:
                path, last = self._walk_greedy(tree, tokens, verified)
            session.commit_path(path)
            for node in path:
                yield tokens[node]
            yield last
            pending = last

    @staticmethod
    def _walk_greedy(tree, tokens, verified):
        path, node = [], 0
        while True:
            want = verified[node]
            nxt = next((ch for ch in tree.children(node) if tokens[ch] == want), None)
            if nxt is None:
                return path, want
            path.append(nxt)
            node = nxt

    @staticmethod
    def _walk_sampled(tree, tokens, rows, probs, rng):
        path, node = [], 0
        while True:
            r = probs(rows[node])
            for ch in tree.children(node):
                total = r.sum()
                t = tokens[ch]
                if total > 0 and uniform(rng) * total < r[t]:
                    break
                r[t] = 0.0
            else:
                total = r.sum()
                return path, draw(r / total if total > 0 else probs(rows[node]), uniform(rng))
            path.append(ch)
            node = ch


@hookimpl
def tinyloop_decoders():
    return [TreeSpeculativeDecoder]
