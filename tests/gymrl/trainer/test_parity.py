"""The parity gate: figures within the dtype's tolerance pass; outside it the run stops (or
warns) with a message naming the agent, the figure and the bound."""

import math

import pytest

from gymrl.config.schema import ParityGateConfig, ParityToleranceConfig
from gymrl.trainer.parity import ParityGateError, check_parity, parity_problems

GATE = ParityGateConfig(
    float32=ParityToleranceConfig(logprob_diff_mean=1e-4, logprob_diff_max=1e-3, ratio_std=1e-4),
    bfloat16=ParityToleranceConfig(logprob_diff_mean=1e-2, logprob_diff_max=0.5, ratio_std=0.05),
)


def _figures(mean, largest, std):
    return {"logprob_diff/mean": mean, "logprob_diff/max": largest, "ratio/std": std}


def test_the_tolerance_follows_the_compute_dtype():
    figures = {"calc": _figures(5e-3, 0.2, 0.01)}
    assert check_parity(figures, GATE, "bfloat16")
    with pytest.raises(ParityGateError) as caught:
        check_parity(figures, GATE, "float32")
    message = str(caught.value)
    assert "calc: logprob_diff/mean = 0.005 > 0.0001" in message
    assert "calc: logprob_diff/max = 0.2 > 0.001" in message
    assert "grpo.parity_gate.float32" in message


def test_only_the_agents_outside_are_named_and_nan_never_passes():
    figures = {"ok": _figures(1e-5, 1e-4, 1e-5), "bad": _figures(math.nan, 1e-4, 1e-5)}
    assert parity_problems(figures, GATE.float32) == ["bad: logprob_diff/mean = nan > 0.0001"]


def test_warn_returns_false_and_goes_on(caplog):
    gate = GATE.model_copy(update={"on_failure": "warn"})
    assert not check_parity({"calc": _figures(1.0, 1.0, 1.0)}, gate, "bfloat16")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage().startswith("parity gate: at the first step")


def test_no_figures_or_an_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="no agent's figures"):
        check_parity({}, GATE, "float32")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        check_parity({"a": _figures(0, 0, 0)}, GATE, "float16")
