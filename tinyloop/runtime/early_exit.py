"""Adaptive depth: per-token early exit from the loop (GenerateConfig.early_exit_*).

A decode step of one token runs the loop iterations one at a time and *probes* the state between
them. The spec's semantics, with the depth d counted in loop iterations run:

* probes are taken at depths ``min_L, min_L + peek_every, min_L + 2 * peek_every, ...`` below
  ``loops`` (a probe at the full depth could not save anything, so none is taken there);
* a probe is *stable* when the request's exit criterion (a plugin, :class:`ExitCriterion`) says so
  for the probed value and the previous one. A criterion that compares two probes gets its first
  reference at depth ``max(0, min_L - peek_every)``, so every comparison spans ``peek_every``
  iterations except that the first one spans ``min_L`` when min_L < peek_every;
* after ``patience`` consecutive stable probes the token exits at the depth of the last one: its
  state goes through the post blocks and the head as if the loop had ended there;
* never beyond ``loops``: a token that never becomes stable runs every iteration.

Prompt positions (the prefill) always run at full depth; exits apply to decode steps.

The skipped iterations' cache layers (loop iterations d .. loops-1 of an exited token's position)
are read by every later token that runs deeper. ``early_exit_kv`` says what they hold:

* ``copy_last`` (default): the K/V of the last iteration the token ran (d - 1), for the same loop
  layer (backend capability ``kv_layer_copy``). Huginn-0125's "latest-m4" cache policy is the
  analogue for its four-layer core.
* ``recompute``: each skipped (iteration i, loop layer j) gets layer j's K/V projections of the
  state iteration i would start from if the exited state were its fixed point: the exited state,
  injected as the model injects its loop input (add: i > 0; adapter: every i). One K/V
  projection per skipped layer (attention and MLP are not run); exact for iteration d itself
  when n_loop = 1.

The statistics the criteria compute are documented on each built-in (tinyloop.plugins.exits) and
in docs/ARCHITECTURE.md ("Early exit").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional, Tuple

import numpy as np

from ..errors import BackendError, ConfigError, IncompatibleModesError, PluginError, TinyLoopError
from .stopping import plugin_call


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


def rel_l2(cur: np.ndarray, prev: np.ndarray) -> float:
    """||cur - prev||_2 / ||cur||_2 (0 when both are zero, inf when only cur is)."""
    n = float(np.sqrt(np.sum(cur * cur)))
    d = float(np.sqrt(np.sum((cur - prev) ** 2)))
    return d / n if n > 0 else (0.0 if d == 0 else float("inf"))


def top2_margin(cur: np.ndarray, prev=None) -> float:
    """cur's largest value minus its second largest."""
    top2 = np.partition(cur, -2)[-2:]
    return float(top2[1] - top2[0])


def kl(cur: np.ndarray, prev: np.ndarray) -> float:
    """KL(softmax(cur) || softmax(prev)) in nats."""
    lp, lq = _log_softmax(cur), _log_softmax(prev)
    return max(0.0, float(np.sum(np.exp(lp) * (lp - lq))))


def argmax_change(cur: np.ndarray, prev: np.ndarray) -> float:
    """0 when argmax cur == argmax prev (ties to the lowest index), else 1."""
    return 0.0 if int(np.argmax(cur)) == int(np.argmax(prev)) else 1.0


def gate_log_survival(cur: np.ndarray, weight: np.ndarray, bias: float) -> float:
    """log(1 - sigmoid(z)) = -softplus(z) of the exit gate's logit z = weight . cur + bias, in
    float64: the log-probability that a token which reached this state does not exit here."""
    z = float(np.dot(np.asarray(weight, np.float64), cur)) + float(bias)
    return -(max(z, 0.0) + math.log1p(math.exp(-abs(z))))


def gate_cdf(log_survival: float) -> float:
    """The cumulative exit probability 1 - exp(S) of a running log-survival S (the sum of
    gate_log_survival over the token's iterations so far)."""
    return -math.expm1(log_survival)


#: The cumulative statistic of a model's learned exit gate (the "gate" criterion): unlike those
#: of STATISTICS it reads the gate's weights (passed to GuardedSteps.exit_probe) and a running
#: log-survival that exit_reset clears; stable at or above the threshold.
GATE_CDF = "gate_cdf"

#: The probe statistics backends may compute where the state lives (GuardedSteps.exit_stats):
#: name -> (numpy reference over float64 rows, True when a stable probe lies *below* the
#: threshold, False when at or above it).
STATISTICS = {"rel_l2": (rel_l2, True), "top2_margin": (top2_margin, False), "kl": (kl, True),
              "argmax_change": (argmax_change, True)}


#: Every statistic a backend may compute where the state lives (STATISTICS and GATE_CDF) -> True
#: when a stable probe lies below the threshold, False when at or above it.
STABLE_BELOW = {**{name: below for name, (_, below) in STATISTICS.items()}, GATE_CDF: False}


def is_stable(stat_name: str, value: float, threshold: float) -> bool:
    """Whether a probe of statistic `stat_name` with `value` is stable under `threshold`."""
    return value < threshold if STABLE_BELOW[stat_name] else value >= threshold


class ExitCriterion:
    """Base class of exit-criterion plugins (hook ``tinyloop_exit_criteria``).

    A subclass declares ``name`` (GenerateConfig.early_exit_criterion selects it), ``reads``
    ("hidden": the probed value is the residual row after the iteration; "logits": the head's
    logits of that row), ``needs_previous`` (the statistic compares with the previous probe),
    ``default_threshold`` (None: the criterion takes no threshold) and either ``stat`` (a name in
    :data:`STATISTICS`, or :data:`GATE_CDF`: backends with the ``guarded_steps`` capability
    compute it where the state lives, and the numpy reference is the default :meth:`statistic` /
    :meth:`stable`; a GATE_CDF criterion computes its own statistic on the host) or
    its own :meth:`statistic` and :meth:`stable` (``stat`` None: probed on the host, on every
    backend). ``mode`` / ``compat`` tie the plugins to the ``early_exit`` row of
    configs/compat.yaml. Host statistics run on float64 copies of the float32 rows."""

    name: ClassVar[str] = ""
    mode: ClassVar[str] = "early_exit"
    compat: ClassVar[Mapping[str, str]] = {}
    reads: ClassVar[str] = "hidden"
    needs_previous: ClassVar[bool] = True
    default_threshold: ClassVar[Optional[float]] = None
    stat: ClassVar[Optional[str]] = None

    def __init__(self, threshold: Optional[float]):
        self.threshold = threshold

    def bind(self, model, config) -> None:
        """Check the request against the model before any work and take what the criterion needs
        from it (raise a TinyLoopError naming the value); called once per request."""

    def begin_token(self) -> None:
        """A new token's probes start (a criterion with per-token state resets it)."""

    @classmethod
    def threshold_of(cls, config) -> Optional[float]:
        """The threshold a request asks for (validated): early_exit_threshold, or the default."""
        t = config.early_exit_threshold
        if cls.default_threshold is None:
            if t:
                raise ConfigError(f"early_exit_threshold={t} is set, but the {cls.name!r} exit criterion takes "
                                  f"no threshold (leave it at 0)")
            return None
        return float(t) if t > 0 else float(cls.default_threshold)

    def statistic(self, cur: np.ndarray, prev: Optional[np.ndarray]) -> float:
        """The probe's statistic from the probed value `cur` (float64, one row) and the previous
        probe's (None where ``needs_previous`` is False)."""
        if self.stat is None:
            raise NotImplementedError(f"{type(self).__name__} declares no stat and no statistic()")
        return STATISTICS[self.stat][0](cur, prev)

    def stable(self, stat: float) -> bool:
        """Whether a probe of statistic `stat` counts as stable (default: the direction of
        ``self.stat`` against the threshold; below it for a criterion of its own)."""
        if self.stat is None:
            return stat < self.threshold
        return is_stable(self.stat, stat, self.threshold)


def _call(crit: ExitCriterion, what: str, fn, *args):
    """A criterion's hook while decoding (stopping.plugin_call, naming the criterion; only
    tinyloop's own errors pass as they are)."""
    return plugin_call(f"exit criterion {crit.name!r}", what, fn, *args, passes=TinyLoopError)


def _probe_stable(crit: ExitCriterion, cur: np.ndarray, prev: Optional[np.ndarray]) -> bool:
    """The criterion's verdict on one host probe: ``stable(statistic(cur, prev))``, each checked to
    return a number and a bool (PluginError naming the criterion otherwise)."""
    stat = _call(crit, "statistic(cur, prev)", crit.statistic, cur, prev)
    if isinstance(stat, (bool, np.bool_)) or not isinstance(stat, (int, float, np.integer, np.floating)):
        raise PluginError(f"exit criterion {crit.name!r}: statistic() returned {stat!r:.80}, not a number")
    verdict = _call(crit, "stable(value)", crit.stable, stat)
    if not isinstance(verdict, (bool, np.bool_)):
        raise PluginError(f"exit criterion {crit.name!r}: stable() returned {verdict!r:.80}, not a bool")
    return bool(verdict)


@dataclass(frozen=True)
class ExitPlan:
    """A request's early exit, resolved and checked before any work (Plan.exit)."""

    criterion: ExitCriterion
    patience: int
    min_L: int
    peek_every: int
    loops: int
    kv: str

    @property
    def probe_depths(self) -> Tuple[int, ...]:
        """The depths probed: min_L, min_L + peek_every, ... below loops."""
        return tuple(range(self.min_L, self.loops, self.peek_every))

    @property
    def reference_depth(self) -> Optional[int]:
        """The depth of the first probe's reference (None: the criterion compares with nothing)."""
        return max(0, self.min_L - self.peek_every) if self.criterion.needs_previous else None


def resolve_exit(model, config, loops: int, criteria: Mapping[str, type]) -> Optional[ExitPlan]:
    """The request's ExitPlan (None without early exit); typed errors naming the value, before any
    allocation. `criteria`: the registered ExitCriterion classes by name."""
    if config.early_exit_patience == 0:
        return None
    name = config.early_exit_criterion or ("logit_margin" if config.early_exit_logit_margin > 0 else "hidden_l2")
    if name not in criteria:
        raise PluginError(f"early_exit_criterion={name!r} is not a registered exit criterion; available: "
                          f"{', '.join(sorted(criteria))}")
    cls = criteria[name]
    if config.early_exit_logit_margin > 0 and name != "logit_margin":
        raise IncompatibleModesError(
            f"early_exit_logit_margin={config.early_exit_logit_margin} selects the logit_margin criterion, but "
            f"early_exit_criterion={name!r} was asked for (set one of them)")
    criterion = cls(cls.threshold_of(config))
    criterion.bind(model, config)
    if config.early_exit_min_L >= loops:
        raise ConfigError(f"early_exit_min_L={config.early_exit_min_L} leaves no probe before the last of "
                          f"loops={loops} iterations (early exit needs early_exit_min_L < loops)")
    plan = ExitPlan(criterion, config.early_exit_patience, config.early_exit_min_L,
                    config.early_exit_peek_every, loops, config.early_exit_kv)
    n_probes = len(plan.probe_depths)
    if config.early_exit_patience > n_probes:
        raise ConfigError(f"early_exit_patience={config.early_exit_patience} can never be reached: "
                          f"early_exit_min_L={config.early_exit_min_L} and early_exit_peek_every="
                          f"{config.early_exit_peek_every} probe {n_probes} time(s) below loops={loops} "
                          f"(a token exits after `patience` consecutive stable probes)")
    if config.early_exit_kv == "copy_last" and not model.backend.supports("kv_layer_copy"):
        raise BackendError(f"early_exit_kv='copy_last' needs the backend capability 'kv_layer_copy', which the "
                           f"{model.backend.name} backend does not provide (early_exit_kv='recompute' runs on "
                           f"the required ops)")
    return plan


class ExitStep:
    """Runs one-token decode steps with early exit for a session (Session builds one when the
    plan has an ExitPlan). Written against the forward's pieces and backend ops only.

    On a backend with the ``guarded_steps`` capability and a criterion whose statistic it
    computes, the step is handed to ``Backend.replay_guarded`` as stretches between the probes
    (CUDA: one captured graph of conditional nodes, no host round trip per probe). Otherwise the
    probed row is read back after each stretch (each stretch replayed as its own graph where the
    backend has them) and the criterion's statistic runs on the host: one round trip per probe."""

    def __init__(self, session, plan: ExitPlan):
        self.s, self.plan = session, plan
        cfg = session.model.cfg
        self.inject = cfg.keeps_loop_input
        probes = plan.probe_depths
        ref = plan.reference_depth
        # the depths where the host looks at the state: the reference, then every probe
        self.stops = tuple(sorted(set(probes) | ({ref} if ref is not None else set())))
        self.probes = frozenset(probes)
        self._pieces = None         # (ids, pos, cache, key, head, stretches, fills, tail) of the last step
        self.pending = False        # a queued step's depth is not read yet (Session.greedy's look-ahead)

    # ------------------------------------------------------------------ pieces
    def _replay(self, key, fn) -> None:
        s = self.s
        s.model.backend.replay(("exit",) + key + (s.cache,), fn)

    def _probe(self) -> np.ndarray:
        """The probed value of the row now in the residual, as float64."""
        s = self.s
        be, ws = s.model.backend, s.model.ws
        if self.plan.criterion.reads == "logits":
            s.model.fwd.logits(0, 1)
            return np.asarray(be.logits_to_host(ws, 0), np.float64).copy()
        return be.rows_to_host(ws.x, 1)[0].astype(np.float64)

    def _filler(self, depth: int, pos):
        """The ops that fill the skipped iterations' K/V of a token that exits at `depth`."""
        s = self.s
        be, ws, fwd, cache = s.model.backend, s.model.ws, s.model.fwd, s.cache
        spec, L = cache.spec, self.plan.loops
        if self.plan.kv == "copy_last":
            def fill():
                for src, dst in spec.skipped_loop_layers(depth, L):
                    be.copy_kv_layers_at(cache, pos, src, dst)
            return fill

        def fill():
            src = ws.x
            if self.inject:
                fwd.inject(ws.snap_x, ws.x, depth, 1)
                src = ws.snap_x
            for i in range(depth, L):
                for j, blk in enumerate(fwd.w.loop):
                    be.kv_project(ws, blk, cache, spec.layer("loop", j, iteration=i), pos, 1, src)
        return fill

    def _finish(self, pos) -> None:
        """After the loop: the post blocks, the logits, their argmax started, the position advanced
        (the end of every step, as the plain step ends)."""
        s = self.s
        s.model.fwd.suffix(pos, 1, s.cache)
        s.model.fwd.logits(0, 1)
        s.model.backend.launch_argmax(s.model.ws)
        s.model.backend.advance_position(pos)

    # ------------------------------------------------------------------ on the device
    def guarded(self) -> bool:
        """The backend runs this criterion's probes where the state lives (GuardedSteps)."""
        be, stat = self.s.model.backend, self.plan.criterion.stat
        return stat is not None and be.supports("guarded_steps") and stat in be.exit_stats

    def _guarded_step(self, ids, pos) -> int:
        """One step as the backend's guarded replay, its depth read back at once."""
        self.queue(ids, pos)
        self.pending = False
        return self.account(self.s.model.backend.exit_depth())

    def queue(self, ids, pos) -> None:
        """Queue one guarded step without reading its depth (``pending`` until begin_pending or
        read_pending): the stretches between stops run while no probe has asked to exit; the
        probes decide where the state lives. The pieces are made once per (ids, pos, cache)
        handles (a backend whose handles are device buffers passes the same ones every step)."""
        s = self.s
        c = self._pieces
        if c is None or c[0] is not ids or c[1] is not pos or c[2] is not s.cache:
            c = self._pieces = (ids, pos, s.cache) + self._make_pieces(ids, pos)
        s.model.backend.replay_guarded(*c[3:])
        self.pending = True

    def account(self, recorded: int) -> int:
        """The depth of a guarded step from what the backend recorded (0: no exit), with its probes
        counted."""
        depth = recorded or self.plan.loops
        self.s.stats.exit_probes += sum(1 for p in self.probes if p <= depth)
        return depth

    def begin_pending(self) -> bool:
        """Queue the read of a pending step's depth (before the next step is queued); True when one
        was pending (finish with ``account(backend.queued_exit_depth())`` once a later wait covers
        the copy)."""
        if not self.pending:
            return False
        self.s.model.backend.queue_exit_depth()
        self.pending = False
        return True

    def read_pending(self) -> Optional[int]:
        """The depth of a pending step, waiting for it (None: none pending)."""
        if not self.pending:
            return None
        self.pending = False
        return self.account(self.s.model.backend.exit_depth())

    def _make_pieces(self, ids, pos) -> tuple:
        """(key, head, stretches, fills, tail) of a guarded step for these handles. The head runs
        up to the first comparing probe (a reference probe cannot exit, so nothing before it needs
        a guard); each stretch runs to the next probe (the last one to the full depth). With
        copy_last the tail copies the skipped layers' K/V for whatever depth was recorded
        (GuardedSteps.exit_copy_last), so no fill is guarded by depth."""
        s, plan = self.s, self.plan
        be, fwd, ws, cache = s.model.backend, s.model.fwd, s.model.ws, s.cache
        L, crit = plan.loops, plan.criterion
        probes = sorted(self.probes)
        ref = plan.reference_depth
        logits = crit.reads == "logits"
        w = fwd.w
        gate = (w.exit_gate, w.exit_gate_bias) if crit.stat == GATE_CDF else None

        def probe(d, compare=True):
            if logits:
                fwd.logits(0, 1)
            be.exit_probe(ws, ws.logits if logits else ws.x, crit.stat, crit.threshold, plan.patience, d,
                          compare=compare, gate=gate)

        def head():
            fwd.prefix(ids, pos, 1, cache)
            done = 0
            if ref is not None:
                fwd.run_loop_iters_range(pos, 1, cache, 0, ref)
                probe(ref, compare=False)
                done = ref
            fwd.run_loop_iters_range(pos, 1, cache, done, probes[0])
            probe(probes[0])

        def stretch(a, b):
            def fn():
                fwd.run_loop_iters_range(pos, 1, cache, a, b)
                if b < L:
                    probe(b)
            return fn
        bounds = probes + [L]
        stretches = [stretch(bounds[k], bounds[k + 1]) for k in range(len(probes))]
        copy_last = plan.kv == "copy_last"
        fills = {} if copy_last else {d: self._filler(d, pos) for d in probes}

        def tail():
            if copy_last:
                be.exit_copy_last(cache, pos, L)
            self._finish(pos)
        key = ("exit-guarded", crit.name, crit.threshold, plan.patience, plan.min_L, plan.peek_every, L, plan.kv,
               cache)
        return key, head, stretches, fills, tail

    # ------------------------------------------------------------------ the step
    def step(self, ids, pos, forced: Optional[int] = None) -> int:
        """Forward one token (ids, pos: backend handles) with early exit; leaves its
        logits (and their argmax, started) pending like the plain step. `forced`: run exactly that
        depth without probing (the uncached reference path replaying recorded depths). Returns
        the depth run."""
        s, plan = self.s, self.plan
        if forced is None and self.guarded():
            return self._guarded_step(ids, pos)
        fwd, cache = s.model.fwd, s.cache
        L, crit = plan.loops, plan.criterion
        stops = (forced,) if forced is not None and forced < L else (() if forced is not None else self.stops)
        done, prev, run, depth = 0, None, 0, L
        started = False             # the prefix has run (a reference stop at depth 0 runs only it)
        _call(crit, "begin_token()", crit.begin_token)
        for d in stops:
            first = not started

            def stretch(a=done, b=d, first=first):
                if first:
                    fwd.prefix(ids, pos, 1, cache)
                fwd.run_loop_iters_range(pos, 1, cache, a, b)
            self._replay(("run", done, d, first), stretch)
            done, started = d, True
            if forced is not None:
                depth = d
                break
            cur = self._probe()
            if d not in self.probes:
                prev = cur
                continue
            stable = _probe_stable(crit, cur, prev if crit.needs_previous else None)
            prev = cur
            s.stats.exit_probes += 1
            run = run + 1 if stable else 0
            if run >= plan.patience:
                depth = d
                break
        if depth < L:
            # the fill's ops depend on the K/V policy: the key names it (a cache, with its graphs, may
            # serve a later request of another policy)
            self._replay(("fill", plan.kv, depth, L), self._filler(depth, pos))

        def tail(a=done, first=done == 0):
            if first:
                fwd.prefix(ids, pos, 1, cache)
            fwd.run_loop_iters_range(pos, 1, cache, a, depth)
            self._finish(pos)
        self._replay(("tail", done, depth), tail)
        return depth
