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
        """x = pre_blocks(embed(ids)) for T rows, then the loop's initial state; e = the loop
        input when the model keeps it (add: x itself; adapter: Ae @ x, the adapter's half that
        does not change between iterations)."""
        b, ws, cfg = self.b, self.ws, self.cfg
        b.embed(self.w.embed, ids, ws.x, T)
        spec = cache.spec
        for i, blk in enumerate(self.w.pre):
            self._block(blk, cache, spec.layer("pre", i), pos, T)
        if cfg.loop_inject == "add":
            b.copy(ws.e, ws.x, T)
        elif cfg.loop_inject == "adapter":
            b.matmul(ws.x, self.w.loop_adapter_e, ws.e, T)
        if cfg.loop_init == "zeros":
            b.zero(ws.x, T)
        elif cfg.loop_init == "random":
            b.init_state(ws.x, pos, T)

    def inject(self, dst: Any, src: Any, it: int, T: int) -> None:
        """dst = the state entering loop iteration `it` from state rows `src` and the loop input
        ws.e (dst may be src; ws.h is clobbered for the adapter)."""
        b, ws, cfg = self.b, self.ws, self.cfg
        if cfg.loop_inject == "add" and it > 0:
            if dst is not src:
                b.copy(dst, src, T)
            b.add(dst, ws.e, T)
        elif cfg.loop_inject == "adapter":
            b.copy(ws.h, ws.e, T)
            b.matmul(src, self.w.loop_adapter_x, ws.h, T, accumulate=True)
            b.copy(dst, ws.h, T)
        elif dst is not src:
            b.copy(dst, src, T)

    def run_loop_iters_range(self, pos: Any, T: int, cache, start_iter: int, end_iter: int) -> None:
        """Loop iterations start_iter .. end_iter-1 on the residual x (cache layers of those iterations)."""
        cfg, spec, ws = self.cfg, cache.spec, self.ws
        for it in range(start_iter, end_iter):
            self.inject(ws.x, ws.x, it, T)
            for j, blk in enumerate(self.w.loop):
                self._block(blk, cache, spec.layer("loop", j, iteration=it), pos, T)
            if cfg.loop_norm == "every":
                self.b.rmsnorm(ws.x, self.w.loop_norm, ws.x, T)

    def suffix(self, pos: Any, T: int, cache, part: str = "post") -> None:
        """The after-loop norm (loop_norm "after"), then the post blocks. Their cache layers are
        the spec's `part` group: ``post``, or another group of n_post layers (a speculative draft
        keeps its post layers apart from the verify depth's in ``draft_post``)."""
        spec = cache.spec
        if self.cfg.loop_norm == "after":
            self.b.rmsnorm(self.ws.x, self.w.loop_norm, self.ws.x, T)
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
