"""Static lockstep batching: N prompts decode together, one launch per op per step.

The spec's "Batching and Integration" shape, on backends with the ``lanes`` capability
(tinyloop.runtime.backend.LaneOps):

1. **One cache, N lane regions.** The cache's slot map has ``lanes = N`` (tinyloop.runtime.cache.
   SlotMap): lane l's position p lives in slot ``l * lane_slots + p``, lane_slots = the longest
   prompt + max_tokens. Every lane uses the request's cache mode.
2. **Prefill** of every lane's prompt but its last token, batched across lanes: the rows of all
   lanes are packed into launches of up to the workspace's rows, each row carrying its lane and
   position (Backend.lane_positions). No logits are computed there.
3. **Lockstep steps.** Each step is one forward over one row per running lane (its last token, at
   its own position, attending to its own region), the logits of every row and their argmax: a
   fixed op sequence the backend captures once per (rows, loops, cache) and replays. The first
   step feeds each lane's last prompt token, so it yields every lane's first token. A lane that
   stops leaves the launch (the batch compacts: the rows are lanes, so a smaller launch is just
   fewer rows; see docs/BENCHMARKS.md for the measurement against keeping stopped lanes in place).
4. **Per-lane picks on the host side**: each lane has its own decoder instance (``Decoder.pick``),
   processor chain (repetition penalty, grammar), stop rules and GenerateStats. A greedy lane
   whose chain leaves the argmax alone reads the device argmax (only ids cross to the host);
   any other lane reads its logits row.

Exactness: with batch-invariant kernels a lane's rows are computed exactly as the same rows of a
one-sequence decode (the lanes launch runs as a draft-tree layout rooted at position 0 whose
paths are the lane's slots; attention reduces keys in position order either way), so every lane's
greedy tokens equal ``generate`` of its prompt, on every backend — tested.

Seeds: lane i of a batch whose config has ``sample_seed = s`` samples with :func:`lane_seed`(s, i)
(lane 0 with s itself), so equal prompts give different samples; a caller who wants given seeds
passes one GenerateConfig per lane (generate_batch), which are used as they are.
"""

from __future__ import annotations

import time
from typing import List, Sequence

import numpy as np

from .cache import SlotMap
from .config import MAX_SEED, GenerateStats, StopReason, env_switch, numpy_int
from ..errors import InvalidInputError, ModelFreedError, PluginError, TinyLoopError
from .decoding import is_token, raised_by_plugin_code
from .stopping import StopRequest


def lane_seed(seed: int, lane: int) -> int:
    """The sample_seed lane `lane` of a batch samples with when the batch's config has
    sample_seed `seed`: `seed` itself for lane 0, else the first 64-bit word of
    ``numpy.random.SeedSequence(seed, spawn_key=(lane,)).generate_state(1, numpy.uint64)``
    (independent streams for equal prompts; a one-lane batch samples exactly as generate).
    InvalidInputError for a seed outside [0, 2^64) or a lane below 0 (or not an int)."""
    if isinstance(seed, (bool, np.bool_)) or not (isinstance(seed, int) or numpy_int(seed)) or not 0 <= seed <= MAX_SEED:
        raise InvalidInputError(f"seed={seed!r} must be an integer in [0, {MAX_SEED}] (a sample_seed)")
    if isinstance(lane, (bool, np.bool_)) or not (isinstance(lane, int) or numpy_int(lane)) or lane < 0:
        raise InvalidInputError(f"lane={lane!r} must be an integer >= 0 (a lane's place in its batch)")
    if lane == 0:
        return int(seed)
    return int(np.random.SeedSequence(int(seed), spawn_key=(int(lane),)).generate_state(1, np.uint64)[0])


class LaneView:
    """What a lockstep decoder's ``pick`` sees of its lane for one step (tinyloop.runtime.decoding.
    Decoder.pick): ``config``, ``vocab_size``, ``eos_id``, ``eos_ids``, ``index`` (the lane's place
    among the generate_batch call's prompts), ``logits()`` (the lane's pending row after its
    processor chain, float32, host; valid for this step) and ``greedy()`` (its argmax; from the
    device when the chain leaves the argmax alone)."""

    def __init__(self, batch: "LockstepBatch", lane: "_Lane"):
        self._batch, self._lane = batch, lane
        self.config = lane.plan.config
        self.vocab_size = batch.vocab_size
        self.eos_id = batch.model.cfg.eos_id
        self.eos_ids = batch.model.cfg.eos_ids
        self.index = lane.index

    def logits(self) -> np.ndarray:
        lane = self._lane
        if self._batch._ahead:
            raise PluginError(f"decoder {lane.plan.decoder_cls.name!r} declares picks_argmax but its pick read "
                              f"the logits: the next step already runs (a picks_argmax decoder picks "
                              f"lane.greedy())")
        if lane.processed is None:
            np.copyto(lane.buf, self._batch.host_logits()[lane.row])
            lane.chain.apply(lane.buf)
            lane.processed = lane.buf
        return lane.processed

    def greedy(self) -> int:
        if self._lane.chain.argmax_invariant:
            return self._batch.device_argmax()[self._lane.row]
        return int(np.argmax(self.logits()))


class _Lane:
    """One prompt's state in the batch."""

    def __init__(self, region: int, index: int, ids: List[int], plan, stats: GenerateStats, vocab_size: int):
        #: its cache region in this batch; its place among the generate_batch call's prompts
        self.region, self.index = region, index
        self.ids, self.plan, self.stats = list(ids), plan, stats
        self.out: List[int] = []
        self.chain = plan.new_processors()
        self.chain.reset(self.ids)
        self.stoppers = plan.new_stoppers(self.ids, self.chain)
        self.decoder = plan.new_decoder()
        self.buf = np.zeros(vocab_size, np.float32)     # the processed logits row (LaneView.logits)
        self.processed = None
        self.row = -1               # its row in the current step's launch
        self.done = False
        self.end = None             # perf_counter() when the lane stopped (its decode_ms ends there)


class LockstepBatch:
    """N validated prompts (their plans: one per lane, sharing every field but the per-lane ones)
    decoded in lockstep on `model` (the caller holds the model's lock); `first_index`: the first
    one's place among the call's prompts (LaneView.index). ``run()`` returns each lane's generated
    tokens and fills its GenerateStats."""

    #: stopped lanes leave the launch (True) or keep their row with outputs discarded (False:
    #: the spec's description; bench/batch_bench.py measures both)
    compact = True

    def __init__(self, model, prompts: Sequence[List[int]], plans: Sequence, stats: Sequence[GenerateStats],
                 first_index: int = 0):
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        plan = plans[0]
        self.loops = plan.loops
        self.max_tokens = plan.config.max_tokens
        # lane i of this batch is prompt first_index + i of the call (more prompts than the workspace's
        # rows run as several batches)
        self.lanes = [_Lane(i, first_index + i, p, pl, st, self.vocab_size)
                      for i, (p, pl, st) in enumerate(zip(prompts, plans, stats))]
        n = len(self.lanes)
        lane_slots = max(len(p) for p in prompts) + self.max_tokens
        self.spec = plan.cache_spec(self.loops, SlotMap(n * lane_slots, lanes=n))
        self.cache = None               # max_tokens=0 decodes nothing: no cache (as generate)
        if self.max_tokens:
            self.cache = model.backend.alloc_cache(self.spec)
            model._live_cache_bytes += int(getattr(self.cache, "nbytes", 0))
        self._logits = None
        self._argmax = None
        self._rows = 0
        self._pos = None                # the last step's position handle (a look-ahead advances it)
        self._ahead = False             # the pending argmax is read and the next step queued

    def close(self) -> None:
        if self.cache is not None:
            self.model._live_cache_bytes -= int(getattr(self.cache, "nbytes", 0))
            self.model.backend.release_cache(self.cache)
            self.cache = None

    # ------------------------------------------------------------------ per-step reads
    def host_logits(self) -> np.ndarray:
        if self._logits is None:
            self._logits = self.model.backend.logits_block_to_host(self.model.ws, self._rows)
        return self._logits

    def device_argmax(self) -> list:
        if self._argmax is None:
            self._argmax = self.model.backend.read_argmax_rows(self.model.ws, self._rows)
        return self._argmax

    # ------------------------------------------------------------------ the batch
    def _prefill(self) -> None:
        """Every lane's prompt but its last token, packed across lanes into launches (each launch
        as the backend's row pieces, a captured forward per piece size)."""
        be, fwd, ws = self.model.backend, self.model.fwd, self.model.ws
        rows = [(lane.region, p, t) for lane in self.lanes for p, t in enumerate(lane.ids[:-1])]
        for a in range(0, len(rows), ws.rows):
            b = a
            for n in be.row_pieces(min(ws.rows, len(rows) - a)):
                piece = rows[b:b + n]
                b += n
                ids = be.set_ids(ws, [t for _, _, t in piece])
                pos = be.lane_positions(self.cache, [l for l, _, _ in piece], [p for _, p, _ in piece])

                def prefill_rows(ids=ids, pos=pos, n=n):
                    fwd.forward(ids, pos, n, self.cache, self.loops)
                be.replay(("lane-rows", n, self.loops, self.cache), prefill_rows, step=False)
        for lane in self.lanes:
            lane.stats.loop_iters_run += self.loops * (len(lane.ids) - 1)

    def _step(self, running: List[_Lane]) -> None:
        """One lockstep step: the last token of each lane of `running` (row t = running[t]),
        uploaded with the rows' positions."""
        be = self.model.backend
        ids = be.set_ids(self.model.ws, [lane.ids[-1] if not lane.out else lane.out[-1] for lane in running])
        pos = be.lane_positions(self.cache, [lane.region for lane in running],
                                [len(lane.ids) + len(lane.out) - 1 for lane in running])
        self._launch(running, ids, pos, "lanes")

    def _launch(self, running: List[_Lane], ids, pos, kind: str) -> None:
        """The step's fixed op sequence, captured once per (kind, rows, loops, cache): forward,
        every row's logits and argmax, the rows' positions advanced where they live."""
        be, fwd, ws = self.model.backend, self.model.fwd, self.model.ws
        T = len(running)
        self._pos = pos

        def lanes_step(ids=ids, pos=pos):
            fwd.forward(ids, pos, T, self.cache, self.loops)
            fwd.logits(0, T)
            be.launch_argmax_rows(ws, T)
            be.advance_lanes(pos, T)
        be.replay((kind, T, self.loops, self.cache), lanes_step)
        self._rows, self._logits, self._argmax = T, None, None
        for t, lane in enumerate(running):
            lane.row, lane.processed = t, None

    def _queue_ahead(self, running: List[_Lane]) -> None:
        """Greedy look-ahead: the step after the pending one, fed with the pending step's argmax
        where it lives, is queued before those ids are read back (the device never waits for the
        picks). Its rows are `running`'s; a lane that stops on this step's pick makes it a wasted
        step (the next step is then uploaded again, recomputing the same rows)."""
        be, ws = self.model.backend, self.model.ws
        T = len(running)
        be.begin_read_argmax_rows(ws, T)
        self._launch(running, be.device_tokens(ws, T), self._pos, "lanes_chained")
        self._argmax = be.finish_read_argmax_rows(ws, T)
        self._ahead = True

    def run(self) -> List[List[int]]:
        t0 = time.perf_counter()
        be = self.model.backend
        for lane in self.lanes:
            lane.stats.loops_used = self.loops
            lane.stats.decoder = lane.plan.decoder_cls.name
            lane.stats.batch_lanes = len(self.lanes)
            lane.done = self.max_tokens == 0
        # every pick is the device argmax: steps can be queued ahead of the picks
        ahead_ok = (be.supports("device_chaining") and env_switch("TINYLOOP_LOOKAHEAD")
                    and all(lane.plan.decoder_cls.picks_argmax and lane.chain.argmax_invariant
                            for lane in self.lanes))
        if self.max_tokens:
            self._prefill()
        first = True
        queued = None                   # the rows of a step already running ahead
        while True:
            live = [lane for lane in self.lanes if not lane.done]
            if not live:
                break
            running = live if self.compact else self.lanes
            if queued != running:
                self._step(running)
            else:                       # the step queued ahead is the pending one
                self._logits, self._argmax = None, None
            self._ahead = False
            if first:                   # every lane's first-token logits are launched
                for lane in self.lanes:
                    lane.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
                first = False
            # queue the next step unless every lane ends with this pick (max_tokens)
            if ahead_ok and max(len(lane.out) for lane in live) + 1 < self.max_tokens:
                self._queue_ahead(running)
                queued = running
            else:
                queued = None
            for lane in live:
                lane.stats.loop_iters_run += self.loops
                self._pick(lane, t0)
            if self.model._free_pending:
                for lane in self.lanes:
                    if not lane.done:
                        lane.stats.stop_reason = StopReason.CALLBACK_ABORT
                raise ModelFreedError(f"free_model({self.model.path!r}) was called while this batch ran: it "
                                      f"ended after {max(len(lane.out) for lane in self.lanes)} steps and the "
                                      f"model is released")
        end = time.perf_counter()
        for lane in self.lanes:
            if lane.stats.stop_reason is None:
                lane.stats.stop_reason = StopReason.MAX_TOKENS
            if lane.out:       # a lane that stopped early: its own decode time, not the batch's
                lane.stats.decode_ms = ((lane.end or end) - t0) * 1e3 - lane.stats.first_token_ms
            lane.stats.finalize()
            self.model.backend.report(lane.stats)
        return [lane.out for lane in self.lanes]

    def _pick(self, lane: _Lane, t0: float) -> None:
        """Lane `lane`'s token of this step through its decoder, processors and stop rules."""
        V = self.vocab_size
        try:
            tok = lane.decoder.pick(LaneView(self, lane))
        except StopRequest as stop:
            lane.stats.stop_reason = stop.reason
            lane.done, lane.end = True, time.perf_counter()
            return
        except TinyLoopError:
            raise
        except Exception as exc:
            if not raised_by_plugin_code(exc):      # the engine's own failure under the decoder
                raise
            raise PluginError(f"decoder {lane.plan.decoder_cls.name!r}: pick(lane) of lane {lane.index} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if not is_token(tok, V):
            raise PluginError(f"decoder {lane.plan.decoder_cls.name!r} picked {tok!r} for lane {lane.index}, "
                              f"not a token id in [0, {V})")
        tok = int(tok)
        lane.out.append(tok)
        lane.chain.accept(tok)
        lane.stats.tokens_emitted = len(lane.out)
        if len(lane.out) == 1:
            lane.stats.first_token_ms = (time.perf_counter() - t0) * 1e3
        reason = lane.stoppers.check(lane.out)
        if reason is not None:
            lane.stats.stop_reason = reason
            lane.done, lane.end = True, time.perf_counter()
