"""Self-speculative decoding's machinery: the sessions, the draft tree, the options and their checks.

The decoders (speculative.py: chain, tree_speculative.py: tree) own the acceptance rules; this
module owns what they drive. Options (GenerateConfig.options of decoder "speculative" /
"tree_speculative"): :class:`SpeculativeOptions`, :class:`TreeSpeculativeOptions`. The verify
depth is the request's loop depth (``verify_loops``, or GenerateConfig.loops). The public
wrappers (tinyloop.generate_speculative / generate_tree_speculative) turn a SpeculativeConfig into
such a request with :func:`speculative_request`.

The session a speculative decoder drives (``SpeculativeSession``) adds three operations to the
ordinary decode session:

* ``draft(token, k)``   feed `token` at position ``position + k`` through the prefix and loop
  iterations 0..draft_loops-1, stash that residual (and the loop-inject residual) in row k of the
  workspace stash, finish with the post blocks (their cache layers kept apart from the verify
  depth's) and the head, and return the draft's greedy next token.
* ``verify(tokens)``    score ``tokens`` (the pending token and the drafts) at positions
  ``position ..`` at verify_loops in ONE forward and return the greedy token after each row. With
  verify-resume (default) the drafted rows restart from their stashed residuals and run only
  iterations draft_loops..verify_loops-1; the last draft, never fed to the draft pass, first runs
  its first draft_loops iterations alone. Without it, the rows run all verify_loops iterations.
* ``commit(n)``         the pending token and the first n drafts are accepted.

For speculative sampling the decoder reads the draft's logits after each ``draft`` (``logits()``)
and the verify rows' logits (``verify_logits(n)``) and applies the acceptance rule itself.

Why verify-resume is exact: loop iterations below draft_loops at a position depend only on the
tokens up to it and on cache layers below draft_loops, which the draft computes exactly as a
full-depth forward would (the weights are shared and every kernel is batch-invariant); the layers
the verify pass adds never feed back into them. Rejected positions leave nothing that is read
later: cache slots past the committed position are rewritten before any query reaches them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ...runtime.config import (GREEDY_TEMPERATURE, GenerateConfig, GenerateStats, SpeculativeConfig,
                            TreeSpeculativeConfig, check_bool, check_int, plain_number)
from ...runtime.engine import DISABLE_KV_CACHE_ENV, Model, Plan, Session, kv_cache_disabled
from ...errors import ConfigError, IncompatibleModesError, PluginError

#: Most tokens one chain cycle drafts (the backends size their id rows for it).
MAX_DRAFT_AHEAD = 64


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class SpeculativeOptions:
    """Options of the chain self-speculative decoder (GenerateConfig(decoder="speculative",
    options={...})). The sampling knobs, stop sequences and cache settings are the request's own
    GenerateConfig fields."""

    draft_loops: int = 2
    """Cheap draft-pass loop depth, in [1, verify depth - 1]."""
    verify_loops: Optional[int] = None
    """Verify-pass loop depth, in [2, model.max_loops]: the request's loop depth. None: GenerateConfig.loops
    (else the model's default_loops); when both are set they must agree."""
    draft_ahead: int = 4
    """Tokens drafted per verify cycle, in [1, 64]."""
    verify_resume: bool = True
    """Verify resumes each drafted position from the residual the draft left after draft_loops
    iterations and runs only iterations draft_loops..verify_loops-1 (same tokens either way)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):            # numpy integers are integers
            object.__setattr__(self, f.name, plain_number(getattr(self, f.name)))
        if self.verify_loops is not None:
            # a verify depth of 1 leaves no draft depth below it
            check_int("verify_loops", self.verify_loops, 2)
        hi = None if self.verify_loops is None else self.verify_loops - 1
        check_int("draft_loops", self.draft_loops, 1, hi)
        check_int("draft_ahead", self.draft_ahead, 1, MAX_DRAFT_AHEAD)
        check_bool("verify_resume", self.verify_resume)


@dataclass(frozen=True)
class TreeSpeculativeOptions(SpeculativeOptions):
    """Options of the tree self-speculative decoder (decoder="tree_speculative"): the draft tree is
    the full K_branches-ary tree of depth draft_ahead."""

    K_branches: int = 2
    """Candidates kept per draft step, in [1, 16]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("K_branches", self.K_branches, 1, 16)


def validate(model: Model, config: GenerateConfig, opts: SpeculativeOptions) -> None:
    """The model-dependent checks of a speculative request (before any allocation)."""
    if kv_cache_disabled():
        raise IncompatibleModesError(f"{DISABLE_KV_CACHE_ENV}={os.environ[DISABLE_KV_CACHE_ENV]!r} asks for the uncached "
                                     f"reference path, which speculative decoding does not have (its verify pass "
                                     f"reads the drafts' cache); unset it, or decode greedily for the reference")
    cfg = model.cfg
    if opts.verify_loops is not None:
        if opts.verify_loops > cfg.max_loops:
            raise ConfigError(f"verify_loops={opts.verify_loops} is outside the allowed range "
                              f"[2, {cfg.max_loops}] (model.max_loops)")
        if config.loops is not None and config.loops != opts.verify_loops:
            raise ConfigError(f"options verify_loops={opts.verify_loops} and loops={config.loops} disagree: the "
                              f"verify depth is the request's loop depth (set one of them)")
    L = verify_depth(config, opts)
    if L is None:
        L = cfg.default_loops
    if opts.draft_loops >= L:
        raise ConfigError(f"draft_loops={opts.draft_loops} is outside the allowed range [1, {L - 1}] (below the "
                          f"verify depth {L})" if L >= 2 else
                          f"draft_loops={opts.draft_loops}: speculative decoding needs a verify depth >= 2, "
                          f"the request's is {L}")
    rows = model.ws.rows
    if isinstance(opts, TreeSpeculativeOptions):
        n = tree_nodes(opts.K_branches, opts.draft_ahead)
        if n > rows:
            raise ConfigError(f"K_branches={opts.K_branches}, draft_ahead={opts.draft_ahead} make a draft tree of "
                              f"{n} nodes, but a verify pass holds at most {rows} rows (the model's "
                              f"prefill_chunk, at most its max_seq_len); lower K_branches or draft_ahead, or "
                              f"load with a larger prefill_chunk")
        if opts.K_branches > cfg.vocab_size:
            raise ConfigError(f"K_branches={opts.K_branches} exceeds the vocabulary ({cfg.vocab_size})")
    elif opts.draft_ahead + 1 > rows:
        raise ConfigError(f"draft_ahead={opts.draft_ahead} needs {opts.draft_ahead + 1} rows per verify "
                          f"pass, but a verify pass holds at most {rows} rows (the model's prefill_chunk, at "
                          f"most its max_seq_len); lower draft_ahead, or load with a larger prefill_chunk")


def verify_depth(config: GenerateConfig, opts: SpeculativeOptions) -> Optional[int]:
    """The verify (and emitted tokens') loop depth: options verify_loops, else GenerateConfig.loops."""
    return opts.verify_loops if opts.verify_loops is not None else config.loops


def options_of(config: SpeculativeConfig) -> Dict[str, Any]:
    """The decoder options a SpeculativeConfig / TreeSpeculativeConfig stands for."""
    out: Dict[str, Any] = {"draft_loops": config.draft_loops, "verify_loops": config.verify_loops,
                           "draft_ahead": config.draft_ahead, "verify_resume": config.verify_resume}
    if isinstance(config, TreeSpeculativeConfig):
        out["K_branches"] = config.K_branches
    return out


def speculative_request(config: SpeculativeConfig, tree: bool) -> GenerateConfig:
    """The GenerateConfig that runs `config` (the public wrappers' whole job): decoder
    "speculative" or "tree_speculative" at loops = verify_loops with the draft knobs as options.
    The sampling knobs (seed, top_k, top_p) are passed only while sampling, where they are used."""
    context = "tree_speculative" if tree else "speculative"
    cls = TreeSpeculativeConfig if tree else SpeculativeConfig
    if not isinstance(config, cls) or (not tree and isinstance(config, TreeSpeculativeConfig)):
        raise ConfigError(f"{context} decoding takes a {cls.__name__}, got {type(config).__name__}")
    sampling = dict(sample_seed=config.seed, top_k=config.top_k, top_p=config.top_p) \
        if config.temperature > GREEDY_TEMPERATURE else {}
    return GenerateConfig(max_tokens=config.max_tokens, loops=config.verify_loops, temperature=config.temperature,
                          stop_sequences=config.stop_sequences, cache_mode=config.cache_mode,
                          cache_window=config.cache_window, decoder=context, options=options_of(config),
                          **sampling)


# --------------------------------------------------------------------------- sessions
class SpeculativeSession(Session):
    """A decode session with draft / verify / commit (see the module docstring)."""

    def __init__(self, model: Model, prompt: List[int], plan: Plan, chain, stats: GenerateStats,
                 extra_slots: Optional[int] = None):
        opts: SpeculativeOptions = plan.options
        # extra layers: the draft's post blocks; extra slots: drafts past the last emitted token
        super().__init__(model, prompt, plan, chain, stats, extra_groups=("draft_post",),
                         extra_slots=opts.draft_ahead + 1 if extra_slots is None else extra_slots)
        self.draft_loops, self.verify_loops = opts.draft_loops, plan.loops
        self.verify_resume = opts.verify_resume
        self.inject = model.cfg.keeps_loop_input
        # cycles asked for with ahead=True: (record slot, depth, branches) of the cycle queued on
        # the device, and the acceptance the device found for the cycle read last (until committed)
        self._queued = None
        self._device_accepted = None

    def _stash(self, row0: int, n: int = 1) -> None:
        """Keep rows 0..n-1 of the residual (and of the loop-inject copy) in stash rows row0.."""
        be, ws = self.model.backend, self.model.ws
        be.copy(be.rows(ws.snap_x, row0), ws.x, n)
        if self.inject:
            be.copy(be.rows(ws.snap_e, row0), ws.e, n)

    def _draft_ops(self, ids, pos, n: int, row0: int, head: bool = True) -> None:
        """A draft pass over n rows: prefix, iterations 0..draft_loops-1, the residual stashed in
        rows row0.., then (head=True) the draft's post blocks and the head into ws.logits[0:n]."""
        fwd, cache, Ld = self.model.fwd, self.cache, self.draft_loops
        fwd.prefix(ids, pos, n, cache)
        fwd.run_loop_iters_range(pos, n, cache, 0, Ld)
        self._stash(row0, n)
        if head:
            fwd.suffix(pos, n, cache, part="draft_post")
            fwd.logits(0, n)

    def _resume(self, pos, n: int) -> None:
        """Rows 0..n-1 restart from the stash and run iterations draft_loops..verify_loops-1, the
        post blocks and the head; the argmax of each row is started on the device."""
        be, fwd, ws, cache = self.model.backend, self.model.fwd, self.model.ws, self.cache
        be.copy(ws.x, ws.snap_x, n)
        if self.inject:
            be.copy(ws.e, ws.snap_e, n)
        fwd.run_loop_iters_range(pos, n, cache, self.draft_loops, self.verify_loops)
        fwd.suffix(pos, n, cache)
        fwd.logits(0, n)
        be.launch_argmax_rows(ws, n)

    def _full_verify(self, ids, pos, n: int) -> None:
        """Rows 0..n-1 through all verify_loops iterations (no resume), the head, argmax per row."""
        fwd = self.model.fwd
        fwd.forward(ids, pos, n, self.cache, self.verify_loops)
        fwd.logits(0, n)
        self.model.backend.launch_argmax_rows(self.model.ws, n)

    def draft(self, token: int, k: int) -> int:
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        ids = be.set_ids(ws, [token])
        pos = be.positions(self.position + k)
        Ld = self.draft_loops

        def step():
            self._draft_ops(ids, pos, 1, k)
            be.launch_argmax(ws)
            be.advance_position(pos)
        be.replay(("draft", Ld, cache, k), step)
        self.stats.loop_iters_run += Ld
        self.stats.drafted_tokens += 1
        return be.read_argmax(ws)

    def verify(self, tokens: Sequence[int]) -> List[int]:
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        n = len(tokens)
        Ld, Lv = self.draft_loops, self.verify_loops
        if self.verify_resume:
            ids = be.set_ids(ws, [tokens[-1]])
            pos = be.positions(self.position + n - 1)

            be.replay(("tail", Ld, cache, n - 1), lambda: self._draft_ops(ids, pos, 1, n - 1, head=False))
            pos0 = be.positions(self.position)
            be.replay(("verify", Ld, Lv, cache, n), lambda: self._resume(pos0, n))
            self.stats.loop_iters_run += Ld + (Lv - Ld)
        else:
            ids = be.set_ids(ws, list(tokens))
            pos0 = be.positions(self.position)
            be.replay(("verify-full", Lv, cache, n), lambda: self._full_verify(ids, pos0, n))
            self.stats.loop_iters_run += Lv
        self.stats.verify_forwards += 1
        return be.read_argmax_rows(ws, n)

    def draft_cycle(self, pending: int, k: int, ahead: bool = False):
        """Greedy draft of k tokens after `pending`, then their verify: ``(drafts, verified)`` with
        verified[i] the verify argmax after row i of [pending] + drafts. The same ops as k calls of
        draft() and one of verify(); where the backend chains tokens on the device they run as ONE
        replayed sequence (each draft step reads the previous step's argmax in place) with a single
        readback at the end, instead of a host round trip per drafted token.

        `ahead` (the cycle's counterpart of greedy(ahead=True)): the caller promises that its next
        calls are commit(n) with n the longest prefix of drafts equal to verified, then
        draft_cycle(verified[n], k, ...) or nothing. Where the backend decides that acceptance on
        the device (capability device_acceptance), the next cycle is then queued before this one
        is read (see _chained_cycle)."""
        be = self.model.backend
        if not be.supports("device_chaining"):
            drafts, tok = [], pending
            for i in range(k):
                tok = self.draft(tok, i)
                drafts.append(tok)
            return drafts, self.verify([pending] + drafts)
        self.stats.loop_iters_run += k * self.draft_loops + self.verify_loops   # the tail's Ld + the resumed Lv - Ld
        self.stats.drafted_tokens += k
        self.stats.verify_forwards += 1
        ids, verified = self._chained_cycle(pending, k, 1, ahead)
        return ids[1:], verified

    def _chained_cycle(self, pending: int, k: int, branches: int, ahead: bool):
        """One chained cycle of depth k (`branches` children per node; a chain: 1), queued by
        _queue_cycle: ``(ids, verified)`` over its nodes. With `ahead` on a device_acceptance
        backend the device decides the acceptance and, unless TINYLOOP_LOOKAHEAD=0, the next cycle
        is queued before this one is read, so the device runs cycle after cycle without waiting
        for the host; it is dropped, unseen, if the request ends (its K/V sit past the accepted
        position, rewritten before any query reaches them). Only queued where the request
        certainly needs it (the tokens this cycle can emit leave max_tokens unreached), so it
        never reaches a slot the host loop would not."""
        be, ws = self.model.backend, self.model.ws
        if not (ahead and be.supports("device_acceptance")):
            n = tree_nodes(branches, k)
            self._queue_cycle(k, pending, None)
            verified = be.read_argmax_rows(ws, n)
            return be.read_ids(ws, n), verified
        queued, self._queued = self._queued, None
        if queued is not None and queued[1:] != (k, branches):
            raise PluginError(f"a cycle of depth {queued[1]} ({queued[2]} branches) was queued ahead, then one of "
                              f"depth {k} ({branches} branches) was asked for: the promise of `ahead` was not kept")
        slot = 0 if queued is None else queued[0]
        if queued is None:
            self._queue_cycle(k, pending, slot)
        if self._lookahead and self.position - self._prompt_len + k + 2 < self.config.max_tokens:
            self._queue_cycle(k, None, 1 - slot)
            self._queued = (1 - slot, k, branches)
        position, n, ids, verified = be.finish_read_cycle(ws, k, slot, branches)
        if position != self.position or ids[0] != pending:
            raise PluginError(f"the cycle of token {ids[0]} at position {position} was queued ahead, then the one "
                              f"of token {pending} at position {self.position} was asked for: the promise of "
                              f"`ahead` was not kept")
        self._device_accepted = n
        return ids, verified

    def _queue_cycle(self, k: int, pending: Optional[int], slot: Optional[int]) -> None:
        """Queue one greedy cycle of k drafts as one replayed sequence; with a record `slot`, the
        device's acceptance and the copy of its record into that host slot. pending None: the
        cycle starts from the token and position the device holds (the acceptance of the cycle
        queued before it)."""
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        Ld, Lv, resume = self.draft_loops, self.verify_loops, self.verify_resume
        if pending is None:
            tok, pos = be.device_token(ws), be.device_position()
        else:
            tok, pos = be.set_ids(ws, [pending]), be.positions(self.position)
        accept = slot is not None

        def cycle():
            be.store_token(ws, 0)
            for i in range(k):
                self._draft_ops(tok, pos, 1, i)
                be.launch_argmax(ws)
                be.store_token(ws, i + 1)
                be.advance_position(pos)
            if resume:
                self._draft_ops(be.rows(ws.ids, k), pos, 1, k, head=False)
                be.advance_position(pos, -k)
                self._resume(pos, k + 1)
            else:
                be.advance_position(pos, -k)
                self._full_verify(ws.ids, pos, k + 1)
            if accept:
                be.launch_accept(ws, k)
        be.replay(("cycle", Ld, Lv, resume, cache, k, accept), cycle)
        if accept:
            be.begin_read_cycle(ws, k, slot)

    def verify_logits(self, n: int):
        """Host copy of the verify pass's n logits rows (speculative sampling)."""
        return self.model.backend.logits_block_to_host(self.model.ws, n)

    def commit(self, n_accepted: int) -> None:
        if self._device_accepted is not None:
            accepted, self._device_accepted = self._device_accepted, None
            if n_accepted != accepted:
                raise PluginError(f"commit({n_accepted}) after a cycle asked for with ahead=True, whose drafts "
                                  f"agree with the verify pass for {accepted}: the device moved the position (and "
                                  f"a tree's cache slots) by that acceptance, so the promise of `ahead` was not kept")
        self.tokens.extend([-1] * (n_accepted + 1))   # placeholders: only the count matters here
        self.position += n_accepted + 1
        self.stats.accepted_tokens += n_accepted


class DraftTree:
    """The full K-ary draft tree of depth D, nodes in breadth-first order.

    Node 0 is the root (the pending token, depth 0); level d holds K^d nodes, indices
    ``level_start[d] .. level_start[d+1]-1``; the children of node i (level d < D) are the K
    consecutive nodes starting at ``level_start[d+1] + (i - level_start[d]) * K``, in the order of
    the draft's top-K (best first). ``depth`` and ``path`` are the int32 tables of
    tinyloop.runtime.backend.TreeRows."""

    def __init__(self, K: int, D: int):
        self.K, self.D = K, D
        self.level_start = [tree_nodes(K, d - 1) for d in range(D + 2)]   # tree_nodes(K, -1) = 0
        self.n_nodes = N = self.level_start[D + 1]
        self.depth = np.zeros(N, np.int32)
        self.path = np.zeros((N, D + 1), np.int32)
        for d in range(1, D + 1):
            for j in range(K ** d):
                node = self.level_start[d] + j
                parent = self.level_start[d - 1] + j // K
                self.depth[node] = d
                self.path[node, :d] = self.path[parent, :d]
                self.path[node, d] = node

    def level(self, d: int) -> range:
        return range(self.level_start[d], self.level_start[d + 1])

    def children(self, node: int) -> range:
        d = int(self.depth[node])
        first = self.level_start[d + 1] + (node - self.level_start[d]) * self.K
        return range(first, first + self.K) if d < self.D else range(0)


def tree_nodes(K: int, D: int) -> int:
    """Nodes of the full K-ary tree of depth D, root included."""
    return sum(K ** d for d in range(D + 1))


class TreeSpeculativeSession(SpeculativeSession):
    """A speculative session over a draft tree (tree nodes live in cache slots position + node):

    * ``draft_level(d, tokens)``  the level-d nodes (their tokens given) go through the draft
      depth in one tree-masked launch; returns the draft's top-K next tokens of each node.
    * ``verify_tree(tokens)``     all tree nodes (tokens by node index) at verify_loops in ONE
      tree-masked forward (verify-resume: level-D nodes first run the draft iterations, then every
      node resumes from its stash); returns the verify argmax after each node.
    * ``tree_cycle(pending)``     both of the above for a whole tree, as one replayed sequence where
      the backend keeps token ids on the device.
    * ``commit_path(nodes)``      the root and the accepted nodes (depth 1, 2, ..) are kept: their
      cache slots move to position + depth, then the position advances past them."""

    def __init__(self, model: Model, prompt: List[int], plan: Plan, chain, stats: GenerateStats):
        opts: TreeSpeculativeOptions = plan.options
        self.tree = DraftTree(opts.K_branches, opts.draft_ahead)
        super().__init__(model, prompt, plan, chain, stats, extra_slots=self.tree.n_nodes)
        self.layout = model.backend.tree_layout(self.tree.depth, self.tree.path)

    def draft_level(self, d: int, tokens: Sequence[int]) -> List[List[int]]:
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        tr = self.tree
        row0, n = tr.level_start[d], len(tokens)
        ids = be.set_ids(ws, list(tokens))
        pos = be.tree_positions(self.layout, self.position, row0)
        Ld, K = self.draft_loops, tr.K

        def step():
            self._draft_ops(ids, pos, n, row0)
            be.launch_topk_rows(ws, n, K)
        be.replay(("tree-draft", Ld, cache, self.layout, d, K, n), step)
        self.stats.loop_iters_run += Ld
        self.stats.drafted_tokens += n * K
        return be.read_topk_rows(ws, n, K)

    def verify_tree(self, tokens: Sequence[int]) -> List[int]:
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        tr = self.tree
        N = tr.n_nodes
        Ld, Lv = self.draft_loops, self.verify_loops
        if self.verify_resume:
            leaf0 = tr.level_start[tr.D]
            ids = be.set_ids(ws, list(tokens[leaf0:]))
            pos = be.tree_positions(self.layout, self.position, leaf0)
            nl = N - leaf0

            be.replay(("tree-tail", Ld, cache, self.layout, nl),
                      lambda: self._draft_ops(ids, pos, nl, leaf0, head=False))
            pos0 = be.tree_positions(self.layout, self.position, 0)
            be.replay(("tree-verify", Ld, Lv, cache, self.layout, N), lambda: self._resume(pos0, N))
            self.stats.loop_iters_run += Lv
        else:
            ids = be.set_ids(ws, list(tokens))
            pos0 = be.tree_positions(self.layout, self.position, 0)
            be.replay(("tree-verify-full", Lv, cache, self.layout, N), lambda: self._full_verify(ids, pos0, N))
            self.stats.loop_iters_run += Lv
        self.stats.verify_forwards += 1
        return be.read_argmax_rows(ws, N)

    def tree_cycle(self, pending: int, ahead: bool = False):
        """Draft the whole tree after `pending` and verify it: ``(tokens, verified)``, the token of
        every node (BFS order, tokens[0] = pending) and the verify argmax after each. The same ops
        as draft_level for every level and one verify_tree; where the backend chains tokens on the
        device they run as ONE replayed sequence (each level's top-K lands directly in the id rows
        of the next level, which in BFS order are exactly the flattened (nodes x K) top-K block)
        with one read-back, instead of a host round trip per level.

        `ahead`: the caller promises the greedy rule (commit_path of the path the greedy walk
        finds, then tree_cycle of the verify argmax after its last node, or nothing); where the
        backend decides the acceptance on the device (device_acceptance), it also compacts the
        path's cache slots there and the next cycle is queued before this one is read (as the
        chain's draft_cycle)."""
        be = self.model.backend
        tr = self.tree
        if not be.supports("device_chaining"):
            tokens = [0] * tr.n_nodes
            tokens[0] = pending
            for d in range(tr.D):
                level = tr.level(d)
                for node, top in zip(level, self.draft_level(d, [tokens[i] for i in level])):
                    for child, tok in zip(tr.children(node), top):
                        tokens[child] = tok
            return tokens, self.verify_tree(tokens)
        self.stats.loop_iters_run += tr.D * self.draft_loops + self.verify_loops
        self.stats.drafted_tokens += tr.n_nodes - 1
        self.stats.verify_forwards += 1
        return self._chained_cycle(pending, tr.D, tr.K, ahead)

    def _queue_cycle(self, k: int, pending: Optional[int], slot: Optional[int]) -> None:
        """The tree's cycle (k: its depth D) as one replayed sequence; with a record `slot`, the
        device's acceptance (the accepted path's slots compacted) and the copy of its record into
        that host slot. pending None: the tree's root is the token and position the device holds."""
        be, ws, cache = self.model.backend, self.model.ws, self.cache
        tr = self.tree
        N, K, D, ls = tr.n_nodes, tr.K, tr.D, tr.level_start
        Ld, Lv, resume = self.draft_loops, self.verify_loops, self.verify_resume
        if pending is not None:
            be.set_ids(ws, [pending])
        root = None if pending is None else self.position
        pos = [be.tree_positions(self.layout, root, ls[d]) for d in range(D + 1)]
        accept = slot is not None

        def cycle():
            be.store_token(ws, 0)
            for d in range(D):
                n = ls[d + 1] - ls[d]
                self._draft_ops(be.rows(ws.ids, ls[d]), pos[d], n, ls[d])
                be.launch_topk_rows(ws, n, K, out_row=ls[d + 1])
            if resume:
                self._draft_ops(be.rows(ws.ids, ls[D]), pos[D], N - ls[D], ls[D], head=False)
                self._resume(pos[0], N)
            else:
                self._full_verify(ws.ids, pos[0], N)
            if accept:
                be.launch_accept(ws, D, K, cache)
        be.replay(("tree-cycle", Ld, Lv, resume, cache, self.layout, accept), cycle)
        if accept:
            be.begin_read_cycle(ws, D, slot, K)

    def commit_path(self, nodes: Sequence[int]) -> None:
        moves = [(self.position + node, self.position + d) for d, node in enumerate(nodes, 1) if node != d]
        if moves and self._device_accepted is None:      # (a device acceptance has moved them)
            self.model.backend.move_cache_slots(self.cache, moves)
        self.commit(len(nodes))
