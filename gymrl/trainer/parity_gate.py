"""The parity gate: at a run's first step, engine and trainer hold the same weights, so their
log-probabilities of the sampled tokens may differ only by kernels and precision.

A larger gap is a bug that no amount of training fixes and that biases every step after it: a
temperature the trainer does not divide by, a chat template or tokenizer that differs, a refit
that did not reach the engine, a weight conversion that lost a layer. slime's CI rule is that the
first step's KL is exactly 0; with different kernels (a torch engine against a torch trainer in
bfloat16, SGLang against Megatron) it is not, so the gate compares the first step's figures per
agent (`gymrl.algo.loss.finish_agent_statistics`, computed in the train step's own forward pass)
against a tolerance chosen by compute dtype.

The trainer applies the gate (:class:`ParityCheck`) between the step's backward passes and its
optimizer update: a failed gate with `on_failure=stop` leaves the weights as they were (no step
taken on a batch the gate just called wrong, nothing to refit, a checkpoint still the run's
start), and `warn` takes the step knowing it. :func:`first_step_check` says at which step the
recipe hands the trainer a check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gymrl.algo.loss import finish_agent_statistics
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.grpo import ParityGateConfig, ParityToleranceConfig

log = logging.getLogger(__name__)

# Figure (as finish_agent_statistics names it) -> the tolerance field that bounds it.
_BOUNDS = {
    "logprob_diff/mean": "logprob_diff_mean",
    "logprob_diff/max": "logprob_diff_max",
    "ratio/std": "ratio_std",
}


class ParityGateError(RuntimeError):
    """The first step's trainer and engine log-probabilities disagree beyond the tolerance."""


def parity_problems(
    figures: Mapping[str, Mapping[str, float]], tolerance: ParityToleranceConfig
) -> list[str]:
    """One line per agent and figure beyond `tolerance`, e.g. `calculator_agent:
    logprob_diff/max = 0.91 > 0.5`; empty when every agent is within it."""
    problems = []
    for agent in sorted(figures):
        for figure, bound_name in _BOUNDS.items():
            value, bound = figures[agent][figure], getattr(tolerance, bound_name)
            if not value <= bound:  # also NaN
                problems.append(f"{agent}: {figure} = {value:.4g} > {bound:g}")
    return problems


def check_parity(
    figures: Mapping[str, Mapping[str, float]], gate: ParityGateConfig, compute_dtype: str
) -> bool:
    """Whether every agent's first-step figures are within the tolerance of `compute_dtype`
    (`float32` or `bfloat16`); outside it, raise :class:`ParityGateError` (`on_failure=stop`)
    or print the same message and return False (`warn`)."""
    if compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
    if not figures:
        raise ValueError(
            "the parity gate got no agent's figures (the first step trained on no token)"
        )
    tolerance = gate.float32 if compute_dtype == "float32" else gate.bfloat16
    problems = parity_problems(figures, tolerance)
    if not problems:
        return True
    message = (
        f"parity gate: at the first step, trainer and engine log-probabilities of the sampled "
        f"tokens disagree beyond the {compute_dtype} tolerance (grpo.parity_gate.{compute_dtype}):"
        "\n  " + "\n  ".join(problems) + "\n  With the same weights on both sides this points "
        "at a mismatch between them: the sampling temperature, the chat template or tokenizer, "
        "the refit, or the weight conversion. Fix it, or if the gap is the backends' own "
        f"precision, raise grpo.parity_gate.{compute_dtype}.* (grpo.parity_gate.on_failure=warn "
        "logs it and goes on)."
    )
    if gate.on_failure == "stop":
        raise ParityGateError(message)
    log.warning(message)
    return False


# The step metric a trainer adds when it applied a check (1.0 passed, 0.0 failed under `warn`).
PASSED_METRIC = "parity/passed"


@dataclass(frozen=True)
class ParityCheck:
    """The gate as a trainer applies it to a step's reduced loss metrics, before the update."""

    gate: ParityGateConfig
    compute_dtype: str

    def __call__(self, step_metrics: Mapping[str, float]) -> bool:
        """Whether the step's per-agent figures pass; raises `ParityGateError` with `stop`."""
        figures = finish_agent_statistics(step_metrics)
        return check_parity(figures, self.gate, self.compute_dtype)


def first_step_check(
    gate: ParityGateConfig,
    *,
    step: int,
    first_step: int,
    trajectories: Sequence[Trajectory],
    compute_dtype: Callable[[], str],
) -> ParityCheck | None:
    """The check the trainer applies at `step`: only at this process's first step (also after a
    resume), when the gate is on; None otherwise. Its trajectories must all come from the
    weights of that step, the ones the trainer holds: otherwise trainer and engine differ by an
    update, not by kernels, and the figures mean nothing. `compute_dtype` (the trainer's, asked
    only when a check is made) picks the tolerance."""
    if not gate.enabled or step != first_step:
        return None
    stale = sorted({t.group_id for t in trajectories if t.weight_version != step})
    if stale:  # the producer starts after the first refit, so this would be a bug
        raise RuntimeError(
            f"parity gate: first-step groups {stale[:3]} come from other weights than version "
            f"{step}, so trainer and engine cannot be compared on them"
        )
    return ParityCheck(gate, compute_dtype())
