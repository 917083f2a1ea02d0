"""The looped forward, written once against the backend ops (tinyloop.runtime.backend).

One call moves T token rows at positions pos .. pos+T-1 through the model and appends their K/V to
the cache. It is split into three pieces so that later modes can resume in the middle of the loop:

    prefix(ids)                     embed + pre blocks (+ keep the loop-inject residual e)
    run_loop_iters_range(a, b)      loop iterations a .. b-1 on the residual x
    suffix()                        post blocks (their cache layers: the cache spec's post group)
    logits(row0, n)                 final norm + head on n rows of x

``forward(...)`` composes them. Warm-start and speculative verify-resume call
``run_loop_iters_range`` from a saved residual.
"""

from __future__ import annotations

from typing import Any

from ..model.arch import ModelConfig
from .backend import Backend, ModelWeights, Workspace


class Forward:
    """Binds a backend, its weights and one workspace; owns no memory itself."""

    def __init__(self, cfg: ModelConfig, backend: Backend, weights: ModelWeights, ws: Workspace):
        self.cfg, self.b, self.w, self.ws = cfg, backend, weights, ws

    def _block(self, blk, cache, layer: int, pos: Any, T: int) -> None:
        self.b.attn_half(self.ws, blk, cache, layer, pos, T)
        self.b.mlp_half(self.ws, blk, T)

    def prefix(self, ids: Any, pos: Any, T: int, cache) -> None:
        """x = pre_blocks(embed(ids)) for T rows; e = x when the model injects it into the loop."""
        b, ws = self.b, self.ws
        b.embed(self.w.embed, ids, ws.x, T)
        spec = cache.spec
        for i, blk in enumerate(self.w.pre):
            self._block(blk, cache, spec.layer("pre", i), pos, T)
        if self.cfg.loop_inject == "add":
            b.copy(ws.e, ws.x, T)

    def run_loop_iters_range(self, pos: Any, T: int, cache, start_iter: int, end_iter: int) -> None:
        """Loop iterations start_iter .. end_iter-1 on the residual x (cache layers of those iterations)."""
        cfg, spec = self.cfg, cache.spec
        for it in range(start_iter, end_iter):
            if it > 0 and cfg.loop_inject == "add":
                self.b.add(self.ws.x, self.ws.e, T)
            for j, blk in enumerate(self.w.loop):
                self._block(blk, cache, spec.layer("loop", j, iteration=it), pos, T)

    def suffix(self, pos: Any, T: int, cache, part: str = "post") -> None:
        """Post blocks. Their cache layers are the spec's `part` group: ``post``, or another group
        of n_post layers (a speculative draft keeps its post layers apart from the verify depth's
        in ``draft_post``)."""
        spec = cache.spec
        for i, blk in enumerate(self.w.post):
            self._block(blk, cache, spec.layer(part, i), pos, T)

    def logits(self, row0: int, n: int) -> None:
        """ws.logits[0:n] = head(final_norm(x[row0:row0+n]))."""
        self.b.final_logits(self.ws, self.w, row0, n)

    def forward(self, ids: Any, pos: Any, T: int, cache, loops: int) -> None:
        """Full forward of T rows at `loops` iterations; leaves the final residual in ws.x."""
        self.prefix(ids, pos, T, cache)
        self.run_loop_iters_range(pos, T, cache, 0, loops)
        self.suffix(pos, T, cache)
