"""The parity gate: figures within the dtype's tolerance pass; outside it the run stops (or
warns) with a message naming the agent, the figure and the bound. The gate's wiring: the check
is made at the process's first step only, on trajectories of that step's weights, and the
torch trainer applies it before its update (a real tiny Llama)."""

import math
from dataclasses import replace

import pytest
import torch

from gymrl.algo.loss import sequence_logprobs
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.grpo import ParityGateConfig, ParityToleranceConfig
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.loading import build_tiny_llama
from gymrl.trainer.parity_gate import (
    PASSED_METRIC,
    ParityCheck,
    ParityGateError,
    check_parity,
    first_step_check,
    parity_problems,
)
from gymrl.trainer.torch_trainer import TorchPolicyTrainer
from tests.gymrl.trainer.fixed_trajectories import fixed_trajectory

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


# ------------------------------------------------------------------ the gate in the train step


def _gate(on_failure: str) -> ParityGateConfig:
    return GATE.model_copy(update={"on_failure": on_failure})


def _trained_trajectories(trainer, engine_shift: float):
    """Two on-policy trajectories whose engine log-probabilities are then moved by
    `engine_shift` (0: the engine agrees with the trainer; 1: it disagrees beyond any bound)."""
    trajectories = [
        _on_policy(trainer, [5, 6, 7, 8], [100, 101, 102], group="g0"),
        _on_policy(trainer, [5, 6, 7, 8], [200, 201, 202], group="g0"),
    ]
    return [
        replace(
            t,
            generation_logprobs=[
                lp - engine_shift if m else 0.0
                for lp, m in zip(t.generation_logprobs, t.loss_mask, strict=True)
            ],
        )
        for t in trajectories
    ]


def _on_policy(trainer, prompt, generation, group):
    ids = torch.tensor([prompt + generation])
    mask = [0] * len(prompt) + [1] * len(generation)
    with torch.no_grad():
        logprobs = sequence_logprobs(trainer.model(input_ids=ids).logits, ids, 1.0)[0].tolist()
    return Trajectory(prompt + generation, mask, logprobs, 1.0, "calc", group, 0)


@pytest.fixture
def trainer(tokenizer):
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
    )
    return TorchPolicyTrainer(
        model,
        TorchTrainerConfig(optimizer=TorchOptimizerConfig(lr=1e-2)),
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )


def _weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_a_failed_gate_that_stops_leaves_the_weights_as_they_were(trainer):
    before = _weights(trainer)
    trajectories = _trained_trajectories(trainer, engine_shift=1.0)
    check = ParityCheck(_gate("stop"), "float32")
    with pytest.raises(ParityGateError, match=r"calc: logprob_diff/mean = 1 > 0\.0001"):
        trainer.train_step(trajectories, torch.tensor([1.0, -1.0]), check)
    after = _weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert trainer.weight_version == 0
    assert not trainer.optimizer.state  # no Adam moment was taken from the batch either
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_failed_gate_that_warns_takes_the_step_and_says_so(trainer, caplog):
    before = _weights(trainer)
    trajectories = _trained_trajectories(trainer, engine_shift=1.0)
    metrics = trainer.train_step(
        trajectories, torch.tensor([1.0, -1.0]), ParityCheck(_gate("warn"), "float32")
    )
    assert metrics[PASSED_METRIC] == 0.0
    assert trainer.weight_version == 1
    after = _weights(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_passed_gate_is_reported_and_no_check_reports_nothing(trainer):
    trajectories = _trained_trajectories(trainer, engine_shift=0.0)
    checked = trainer.train_step(
        trajectories, torch.tensor([1.0, -1.0]), ParityCheck(_gate("stop"), "float32")
    )
    assert checked[PASSED_METRIC] == 1.0
    unchecked = trainer.train_step(trajectories, torch.tensor([1.0, -1.0]))
    assert PASSED_METRIC not in unchecked


def _asked_dtype():
    asked = []

    def compute_dtype():
        asked.append(True)
        return "bfloat16"

    return compute_dtype, asked


def test_the_check_is_made_at_the_processes_first_step_only():
    trajectories = [replace(fixed_trajectory(2, 2), weight_version=3)]
    compute_dtype, asked = _asked_dtype()
    for step in (4, 5):
        assert (
            first_step_check(
                GATE,
                step=step,
                first_step=3,
                trajectories=trajectories,
                compute_dtype=compute_dtype,
            )
            is None
        )
    assert not asked  # no call to the trainer at later steps
    check = first_step_check(
        GATE, step=3, first_step=3, trajectories=trajectories, compute_dtype=compute_dtype
    )
    assert check == ParityCheck(GATE, "bfloat16")
    off = GATE.model_copy(update={"enabled": False})
    assert (
        first_step_check(
            off, step=3, first_step=3, trajectories=trajectories, compute_dtype=compute_dtype
        )
        is None
    )


def test_first_step_trajectories_from_other_weights_are_refused_by_name():
    trajectories = [
        fixed_trajectory(2, 2, group="fresh"),
        replace(fixed_trajectory(2, 2, group="stale"), weight_version=1),
    ]
    compute_dtype, _ = _asked_dtype()
    with pytest.raises(RuntimeError, match=r"groups \['stale'\] come from other weights"):
        first_step_check(
            GATE, step=0, first_step=0, trajectories=trajectories, compute_dtype=compute_dtype
        )
