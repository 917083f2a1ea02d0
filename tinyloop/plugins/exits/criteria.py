"""The built-in early-exit criteria (GenerateConfig.early_exit_criterion; tinyloop.runtime.early_exit).

Each probe looks at one row: the residual after the probed iteration (``hidden``), or the head's
logits of that residual (``logits``: the final norm and head applied to the probed state, as the
post blocks are not; one extra head evaluation per probe). With x the probed residual, x' the
previous probe's, z the probed logits and z' the previous probe's:

===============  ============================================  ======================  =========
criterion        statistic                                     stable when             default
===============  ============================================  ======================  =========
hidden_l2        ||x - x'||_2 / ||x||_2                        statistic < threshold   0.1
logit_margin     z[top1] - z[top2] (this probe only)           statistic >= margin     3.0
kl               KL(softmax(z) || softmax(z')), in nats        statistic < threshold   0.01
argmax           argmax z == argmax z' (1 when it changed)     statistic == 0          none
gate             1 - prod_{i <= d} (1 - sigmoid(g . x_i + b))  statistic >= threshold  0.5
===============  ============================================  ======================  =========

gate is Ouro's learned exit: the model's exit gate (ModelConfig.exit_gate: weight g, bias b)
gives each iteration i's state x_i an exit probability lambda_i = sigmoid(g . x_i + b); the
statistic is the cumulative probability of having exited by depth d, and the token exits at the
first depth where it reaches the threshold (the Ouro paper's rule; patience p > 1 waits p - 1
more iterations). It needs every iteration's gate: early_exit_min_L = early_exit_peek_every = 1.
Its threshold is a probability in (0, 1].

logit_margin reads its margin from the spec's ``early_exit_logit_margin`` (> 0 also selects it when
no criterion is named); the others from ``early_exit_threshold`` (0: the default above). The
defaults of hidden_l2, logit_margin and kl keep the demo model's perplexity within about 1 % at its
default depth (the protocol of docs/BENCHMARKS.md, "Early exit": kl 0.01 +0.32 %, logit_margin 3.0
+0.67 %; hidden_l2 0.1 never exits there). gate's 0.5 is Ouro's own exit threshold, not such a
point: on demo-exit nearly every token leaves after one iteration at 0.5 (mean depth 1.04 of 4,
+13.2 % perplexity); 0.9 is its setting there (docs/BENCHMARKS.md, "An exit-trained sibling").
"""

from __future__ import annotations

from ...errors import ConfigError, IncompatibleModesError
from ...runtime.early_exit import GATE_CDF, ExitCriterion, gate_cdf, gate_log_survival
from ...runtime.hookspecs import hookimpl

#: The early_exit row of configs/compat.yaml.
EXIT_COMPAT = {"single": "ok", "batched": "rejected", "speculative": "rejected", "tree_speculative": "rejected",
               "prefix_reuse": "ok", "warm_start": "rejected"}


class HiddenL2(ExitCriterion):
    """Relative L2 change of the residual since the previous probe (the spec's default)."""

    name = "hidden_l2"
    compat = EXIT_COMPAT
    reads = "hidden"
    stat = "rel_l2"
    default_threshold = 0.1


class LogitMargin(ExitCriterion):
    """Top-1 minus top-2 of the probed logits (the spec's early_exit_logit_margin)."""

    name = "logit_margin"
    compat = EXIT_COMPAT
    reads = "logits"
    stat = "top2_margin"
    needs_previous = False
    default_threshold = 3.0

    @classmethod
    def threshold_of(cls, config):
        if config.early_exit_threshold:
            raise ConfigError(f"early_exit_threshold={config.early_exit_threshold} is set, but the logit_margin "
                              f"criterion takes its margin from early_exit_logit_margin (leave the threshold at 0)")
        m = config.early_exit_logit_margin
        return float(m) if m > 0 else float(cls.default_threshold)


class KLDivergence(ExitCriterion):
    """KL divergence of the probed next-token distribution from the previous probe's."""

    name = "kl"
    compat = EXIT_COMPAT
    reads = "logits"
    stat = "kl"
    default_threshold = 0.01


class ArgmaxStable(ExitCriterion):
    """The probed greedy token equals the previous probe's."""

    name = "argmax"
    compat = EXIT_COMPAT
    reads = "logits"
    stat = "argmax_change"
    default_threshold = None

    @classmethod
    def threshold_of(cls, config):
        super().threshold_of(config)        # refuses a threshold
        return 0.5                          # argmax_change is 0 or 1: stable below one half


class ExitGate(ExitCriterion):
    """The model's learned exit gate (Ouro): exit once the cumulative exit probability reaches
    the threshold. Computed where the state lives on a backend with the ``gate_cdf`` statistic
    (tinyloop.runtime.early_exit.GATE_CDF: the log-survivals -softplus(z_i) summed in float64,
    the statistic 1 - exp(sum)); here the same formula on the host."""

    name = "gate"
    compat = EXIT_COMPAT
    reads = "hidden"
    needs_previous = False
    default_threshold = 0.5
    stat = GATE_CDF

    @classmethod
    def threshold_of(cls, config):
        t = super().threshold_of(config)
        if t > 1.0:
            raise ConfigError(f"early_exit_threshold={config.early_exit_threshold} is not a probability in (0, 1] "
                              f"(the gate criterion exits when the cumulative exit probability reaches it)")
        return t

    def bind(self, model, config) -> None:
        if getattr(model, "exit_gate", None) is None:
            raise IncompatibleModesError("early_exit_criterion='gate' needs a model with a learned exit gate "
                                         "(exit_gate: true, e.g. a converted Ouro checkpoint); this model has none")
        if config.early_exit_min_L != 1 or config.early_exit_peek_every != 1:
            raise ConfigError(f"early_exit_criterion='gate' accumulates every iteration's exit probability: it "
                              f"needs early_exit_min_L=1 and early_exit_peek_every=1, got "
                              f"{config.early_exit_min_L} and {config.early_exit_peek_every}")
        self.weight, self.bias = model.exit_gate
        self.log_survival = 0.0

    def begin_token(self) -> None:
        self.log_survival = 0.0

    def statistic(self, cur, prev) -> float:
        self.log_survival += gate_log_survival(cur, self.weight, self.bias)
        return gate_cdf(self.log_survival)

    def stable(self, stat: float) -> bool:
        return stat >= self.threshold


@hookimpl
def tinyloop_exit_criteria():
    return [HiddenL2, LogitMargin, KLDivergence, ArgmaxStable, ExitGate]
