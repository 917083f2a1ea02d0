"""Self-speculative decoding: draft at draft_loops, verify at verify_loops, same weights.

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

from typing import List, Optional, Sequence

from .config import GenerateConfig, GenerateStats, SpeculativeConfig, TreeSpeculativeConfig
from .engine import Model, Session, _iter_locked, _Plan, resolve_loops, validate_request
from .errors import ConfigError, NotImplementedModeError


class SpeculativeSession(Session):
    """A decode session with draft / verify / commit (see the module docstring)."""

    def __init__(self, model: Model, prompt: List[int], plan: _Plan, chain, stats: GenerateStats):
        spec: SpeculativeConfig = plan.decoder_config
        cfg = model.cfg
        # extra layers: the draft's post blocks; extra slots: drafts past the last emitted token
        super().__init__(model, prompt, plan, chain, stats, extra_layers=cfg.n_post,
                         extra_slots=spec.draft_ahead + 1)
        self.spec = spec
        self.draft_loops, self.verify_loops = spec.draft_loops, spec.verify_loops
        self.draft_post0 = cfg.n_layers(spec.verify_loops)
        self.inject = cfg.loop_inject == "add"

    def _stash(self, k: int) -> None:
        be, ws = self.model.backend, self.model.ws
        be.copy(be.rows(ws.snap_x, k), ws.x, 1)
        if self.inject:
            be.copy(be.rows(ws.snap_e, k), ws.e, 1)

    def draft(self, token: int, k: int) -> int:
        be, fwd, ws, cache = self.model.backend, self.model.fwd, self.model.ws, self.cache
        ids = be.set_ids(ws, [token])
        pos = be.positions(self.position + k)
        Ld = self.draft_loops

        def step():
            fwd.prefix(ids, pos, 1, cache)
            fwd.run_loop_iters_range(pos, 1, cache, 0, Ld)
            self._stash(k)
            fwd.suffix(pos, 1, cache, Ld, post_layer0=self.draft_post0)
            fwd.logits(0, 1)
            be.launch_argmax(ws)
            be.advance_position(pos)
        be.replay(("draft", Ld, cache, k), step)
        self.stats.loop_iters_run += Ld
        self.stats.drafted_tokens += 1
        return be.read_argmax(ws)

    def verify(self, tokens: Sequence[int]) -> List[int]:
        be, fwd, ws, cache = self.model.backend, self.model.fwd, self.model.ws, self.cache
        n = len(tokens)
        Ld, Lv = self.draft_loops, self.verify_loops
        if self.spec.verify_resume:
            ids = be.set_ids(ws, [tokens[-1]])
            pos = be.positions(self.position + n - 1)

            def tail():
                fwd.prefix(ids, pos, 1, cache)
                fwd.run_loop_iters_range(pos, 1, cache, 0, Ld)
                self._stash(n - 1)
            be.replay(("tail", Ld, cache, n - 1), tail)
            pos0 = be.positions(self.position)

            def resume():
                be.copy(ws.x, ws.snap_x, n)
                if self.inject:
                    be.copy(ws.e, ws.snap_e, n)
                fwd.run_loop_iters_range(pos0, n, cache, Ld, Lv)
                fwd.suffix(pos0, n, cache, Lv)
                fwd.logits(0, n)
                be.launch_argmax_rows(ws, n)
            be.replay(("verify", Ld, Lv, cache, n), resume)
            self.stats.loop_iters_run += Ld + (Lv - Ld)
        else:
            ids = be.set_ids(ws, list(tokens))
            pos0 = be.positions(self.position)

            def full():
                fwd.forward(ids, pos0, n, cache, Lv)
                fwd.logits(0, n)
                be.launch_argmax_rows(ws, n)
            be.replay(("verify-full", Lv, cache, n), full)
            self.stats.loop_iters_run += Lv
        self.stats.verify_forwards += 1
        return be.read_argmax_rows(ws, n)

    def verify_logits(self, n: int):
        """Host copy of the verify pass's n logits rows (speculative sampling)."""
        return self.model.backend.logits_block_to_host(self.model.ws, n)

    def commit(self, n_accepted: int) -> None:
        self.tokens.extend([-1] * (n_accepted + 1))   # placeholders: only the count matters here
        self.position += n_accepted + 1
        self.stats.accepted_tokens += n_accepted


def _speculative_plan(model: Model, prompt, config, cls, context: str):
    if not isinstance(config, cls):
        raise ConfigError(f"{context} decoding takes a {cls.__name__}, got {type(config).__name__}")
    model._check_live()
    if config.verify_loops > model.cfg.max_loops:
        raise ConfigError(f"verify_loops={config.verify_loops} is outside the allowed range "
                          f"[2, {model.cfg.max_loops}] (model.max_loops)")
    if config.draft_ahead + 1 > model.ws.rows:
        raise ConfigError(f"draft_ahead={config.draft_ahead} needs {config.draft_ahead + 1} rows per verify "
                          f"pass, but the model was loaded with prefill_chunk={model.ws.rows}")
    gc = GenerateConfig(max_tokens=config.max_tokens, loops=config.verify_loops,
                        temperature=config.temperature, sample_seed=config.seed, top_k=config.top_k,
                        top_p=config.top_p,
                        stop_sequences=config.stop_sequences, cache_mode=config.cache_mode, decoder=context)
    plan = _Plan(model, gc, context)
    ids = validate_request(model, prompt, gc)
    resolve_loops(model, config.draft_loops)
    plan.decoder_config = config
    plan.session_cls = SpeculativeSession
    return plan, ids


def generate_speculative(model: Model, prompt: Sequence[int], config: Optional[SpeculativeConfig] = None,
                         stats: Optional[GenerateStats] = None) -> List[int]:
    """Chain self-speculative decoding: draft `draft_ahead` tokens greedily at draft_loops, verify
    them in one forward at verify_loops, accept the longest matching prefix plus one bonus token.
    At temperature 0 the output equals generate(loops=verify_loops). Returns prompt + tokens."""
    plan, ids = _speculative_plan(model, prompt, config or SpeculativeConfig(), SpeculativeConfig,
                                  "speculative")
    stats = stats if stats is not None else GenerateStats()
    return ids + list(_iter_locked(model, ids, plan, stats))


def generate_tree_speculative(model: Model, prompt: Sequence[int],
                              config: Optional[TreeSpeculativeConfig] = None) -> List[int]:
    """Tree self-speculative decoding with K_branches candidates per draft step."""
    config = config or TreeSpeculativeConfig()
    if not isinstance(config, TreeSpeculativeConfig):
        raise ConfigError(f"tree_speculative decoding takes a TreeSpeculativeConfig, got {type(config).__name__}")
    from .compat import check_request
    check_request("tree_speculative", GenerateConfig(max_tokens=config.max_tokens, temperature=config.temperature))
    raise NotImplementedModeError("tree-speculative decoding is not implemented yet")

