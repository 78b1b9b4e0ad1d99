"""GRPO loss on hand-computed cases, and per-token log-probabilities against a manual gather."""

import math

import pytest
import torch

import gymrl.algo.loss as loss_module
from gymrl.algo.loss import (
    finish_agent_statistics,
    grpo_loss,
    masked_token_logprobs,
    merge_agent_statistics,
    sequence_logprobs,
)
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import OffPolicyCorrectionConfig

DEFAULTS = {
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "kl_coef": 0.0,
    # Token truncation with a cap no ratio here reaches: the plain importance ratio.
    "off_policy": OffPolicyCorrectionConfig(mode="token_truncate", ratio_high=1e9),
    "token_level_normalization": True,
}
ON_POLICY = OffPolicyCorrectionConfig(mode="none")


def _loss(logprobs, generation_logprobs, advantages, loss_mask, **overrides):
    return grpo_loss(
        logprobs, generation_logprobs, advantages, loss_mask, **{**DEFAULTS, **overrides}
    )


def _one_token_per_sequence(log_ratios, advantages):
    """B sequences of one generated token each (position 1; position 0 is the prompt)."""
    logprobs = torch.tensor([[0.0, -1.0 + r] for r in log_ratios], requires_grad=True)
    generation = torch.tensor([[0.0, -1.0]] * len(log_ratios))
    mask = torch.tensor([[0, 1]] * len(log_ratios))
    return logprobs, generation, torch.tensor(advantages), mask


# Unequal lengths: sequence 0 has 3 generated tokens with A = 1, sequence 1 has 1 with A = -0.5.
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
ADVANTAGES = torch.tensor([1.0, -0.5])


@pytest.mark.parametrize(
    ("token_level", "expected"),
    [
        (True, -(3 * 1.0 + 1 * -0.5) / 4),  # sum over the 4 tokens / 4 = -0.625
        (False, -(1.0 + -0.5) / 2),  # per-sequence means 1 and -0.5, then their mean = -0.25
    ],
)
def test_on_policy_ratio_is_one_and_normalisation_matters(token_level, expected):
    logprobs = torch.full((2, 4), -0.7, requires_grad=True)
    loss, metrics = _loss(
        logprobs,
        torch.full((2, 4), -5.0),  # ignored without importance-sampling correction
        ADVANTAGES,
        MASK,
        off_policy=ON_POLICY,
        token_level_normalization=token_level,
    )
    assert loss.item() == pytest.approx(expected)
    assert metrics["pg_loss"] == pytest.approx(expected)
    assert metrics["importance_ratio/mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["num_tokens"] == 4.0
    assert metrics["approx_entropy"] == pytest.approx(0.7)


def test_gradient_raises_positive_advantage_tokens_and_lowers_negative_ones():
    logprobs = torch.full((2, 4), -0.7, requires_grad=True)
    loss, _ = _loss(logprobs, torch.zeros(2, 4), ADVANTAGES, MASK, off_policy=ON_POLICY)
    loss.backward()
    # d loss / d logprob = -A / num_tokens on generated tokens, 0 elsewhere.
    expected = torch.tensor([[0.0, -0.25, -0.25, -0.25], [0.0, 0.125, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_clipping_starts_exactly_beyond_one_plus_minus_eps():
    log = math.log
    # ratio, advantage -> per-token loss, gradient:
    #   1.201, +1 -> clipped at 1.2: loss -1.2, grad 0
    #   1.199, +1 -> -1.199, grad -1.199
    #   0.799, -1 -> clipped at 0.8: loss 0.8, grad 0
    #   0.801, -1 -> 0.801, grad 0.801
    #   0.5,   +1 -> the clip never raises a ratio for a positive advantage: -0.5, grad -0.5
    #   2.0,   -1 -> nor lowers one for a negative advantage: 2.0, grad 2.0
    ratios = [1.201, 1.199, 0.799, 0.801, 0.5, 2.0]
    advantages = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    logprobs, generation, adv, mask = _one_token_per_sequence([log(r) for r in ratios], advantages)
    loss, metrics = _loss(logprobs, generation, adv, mask)
    per_token = [-1.2, -1.199, 0.8, 0.801, -0.5, 2.0]
    assert loss.item() == pytest.approx(sum(per_token) / 6, rel=1e-5)
    loss.backward()
    gradients = [0.0, -1.199, 0.0, 0.801, -0.5, 2.0]
    torch.testing.assert_close(logprobs.grad[:, 1], torch.tensor(gradients) / 6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)
    assert metrics["importance_ratio/max"] == pytest.approx(2.0, rel=1e-5)
    assert metrics["importance_ratio/mean"] == pytest.approx(sum(ratios) / 6, rel=1e-5)


def test_importance_sampling_correction_scales_the_ratio_by_exp_new_minus_old():
    logprobs, generation, adv, mask = _one_token_per_sequence([0.5], [1.0])
    corrected, metrics = _loss(logprobs, generation, adv, mask, clip_ratio_high=1.0)
    assert corrected.item() == pytest.approx(-math.exp(0.5))
    assert metrics["importance_ratio/mean"] == pytest.approx(math.exp(0.5))
    plain, _ = _loss(logprobs, generation, adv, mask, off_policy=ON_POLICY)
    assert plain.item() == pytest.approx(-1.0)


def test_ratio_cap_truncates_the_value_but_keeps_a_gradient():
    # ratio exp(0.5) = 1.6487 capped at 1.2; A = -1 so the clip (at 1.1) does not hide it:
    # loss = -min(1.2 * -1, 1.1 * -1) = 1.2, and d loss / d logprob = 1.2 (not 0, not 1.6487).
    logprobs, generation, adv, mask = _one_token_per_sequence([0.5], [-1.0])
    loss, metrics = _loss(
        logprobs,
        generation,
        adv,
        mask,
        clip_ratio_high=0.1,
        off_policy=OffPolicyCorrectionConfig(mode="token_truncate", ratio_high=1.2),
    )
    assert loss.item() == pytest.approx(1.2)
    loss.backward()
    assert logprobs.grad[0, 1].item() == pytest.approx(1.2)
    assert metrics["importance_ratio/max"] == pytest.approx(math.exp(0.5))
    uncapped, _ = _loss(logprobs, generation, adv, mask, clip_ratio_high=0.1)
    assert uncapped.item() == pytest.approx(math.exp(0.5))


def test_kl_k3_by_hand():
    # ref - logprob = -2 - (-1) = -1: k3 = e^-1 - (-1) - 1 = e^-1; d k3 / d logprob = 1 - e^-1.
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[0.0, -2.0]])
    loss, metrics = _loss(
        logprobs,
        torch.tensor([[0.0, -1.0]]),
        torch.tensor([0.0]),
        torch.tensor([[0, 1]]),
        reference_logprobs=reference,
        kl_coef=0.1,
    )
    assert metrics["kl"] == pytest.approx(math.exp(-1))
    assert loss.item() == pytest.approx(0.1 * math.exp(-1))
    loss.backward()
    assert logprobs.grad[0, 1].item() == pytest.approx(0.1 * (1 - math.exp(-1)))


def test_kl_coef_without_reference_is_a_clear_error():
    logprobs, generation, adv, mask = _one_token_per_sequence([0.0], [1.0])
    with pytest.raises(ValueError, match=r"kl_coef=0\.1 needs reference_logprobs"):
        _loss(logprobs, generation, adv, mask, kl_coef=0.1)


def test_masked_positions_cannot_poison_the_loss_or_its_gradient():
    logprobs = torch.tensor([[math.nan, -1.0, math.inf]], requires_grad=True)
    generation = torch.tensor([[-math.inf, -1.0, math.nan]])
    loss, metrics = _loss(logprobs, generation, torch.tensor([2.0]), torch.tensor([[0, 1, 0]]))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(value) for value in metrics.values())


def test_normalizer_makes_micro_batches_sum_to_the_full_batch():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -0.1, 0.0]])
    generation = logprobs - 0.05
    for token_level, total in ((True, 4.0), (False, 2.0)):
        settings = {"token_level_normalization": token_level}
        full, _ = _loss(logprobs, generation, ADVANTAGES, MASK, **settings)
        parts = [
            _loss(
                logprobs[i : i + 1],
                generation[i : i + 1],
                ADVANTAGES[i : i + 1],
                MASK[i : i + 1],
                normalizer=total,
                **settings,
            )[0]
            for i in range(2)
        ]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_shape_mismatches_are_named():
    with pytest.raises(ValueError, match=r"loss_mask has shape \[2, 3\]"):
        _loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \[2\]"):
        _loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))


@pytest.mark.parametrize("chunk", [3, 2048])
def test_sequence_logprobs_equals_a_manual_gather(monkeypatch, chunk):
    monkeypatch.setattr(loss_module, "_CHUNK_POSITIONS", chunk)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    input_ids = torch.randint(0, 11, (2, 5), generator=generator)
    out = sequence_logprobs(logits, input_ids, temperature=0.7)
    assert out.dtype == torch.float32 and out.shape == (2, 5)
    manual = torch.zeros(2, 5)
    for b in range(2):
        for t in range(1, 5):
            distribution = torch.log_softmax(logits[b, t - 1].float() / 0.7, dim=-1)
            manual[b, t] = distribution[input_ids[b, t]]
    torch.testing.assert_close(out, manual)
    (gradient,) = torch.autograd.grad(out.sum(), logits)
    (manual_gradient,) = torch.autograd.grad(manual.sum(), logits)
    torch.testing.assert_close(gradient, manual_gradient)


def test_one_step_on_a_real_model_moves_probabilities_with_the_advantage():
    torch.manual_seed(0)
    vocab = 16
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    good = Trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, 1.0, "a", "g", 0)
    bad = Trajectory([1, 2, 5, 6], [0, 0, 1, 1], [0.0] * 4, 0.0, "a", "g", 0)
    batch = collate([good, bad], advantages=torch.tensor([1.0, -1.0]), pad_token_id=0)
    mask = batch["loss_mask"].bool()

    def generated_logprobs():
        logprobs = sequence_logprobs(model(batch["input_ids"]), batch["input_ids"], 1.0)
        return logprobs, logprobs.masked_fill(~mask, 0.0).sum(dim=1)

    logprobs, before = generated_logprobs()
    loss, _ = _loss(
        logprobs,
        batch["generation_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        off_policy=ON_POLICY,
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        _, after = generated_logprobs()
    assert after[0] > before[0]  # positive advantage: more likely
    assert after[1] < before[1]  # negative advantage: less likely


def test_a_batch_without_generated_tokens_gives_zero_loss():
    logprobs = torch.full((1, 3), -1.0, requires_grad=True)
    for token_level in (True, False):
        loss, metrics = _loss(
            logprobs,
            torch.zeros(1, 3),
            torch.tensor([1.0]),
            torch.zeros(1, 3),
            token_level_normalization=token_level,
        )
        assert loss.item() == 0.0 and metrics["num_tokens"] == 0.0


def test_masked_token_logprobs_equal_sequence_logprobs_on_the_mask_with_the_same_gradient():
    torch.manual_seed(0)
    batch, length, width, vocab = 3, 7, 5, 11
    hidden = torch.randn(batch, length, width, requires_grad=True)
    head = torch.nn.Linear(width, vocab, bias=False)
    input_ids = torch.randint(0, vocab, (batch, length))
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    full = sequence_logprobs(head(hidden), input_ids, temperature=0.7)
    fast = masked_token_logprobs(hidden, head, input_ids, loss_mask, temperature=0.7)
    torch.testing.assert_close(fast, torch.where(loss_mask.bool(), full, 0.0))
    (grad_full,) = torch.autograd.grad((full * loss_mask).sum(), hidden)
    (grad_fast,) = torch.autograd.grad(fast.sum(), hidden)
    torch.testing.assert_close(grad_fast, grad_full)


# ------------------------------------------------------------------ off-policy correction modes
def _mode(mode, low=0.5, high=2.0):
    return OffPolicyCorrectionConfig(mode=mode, ratio_low=low, ratio_high=high)


def test_token_mask_removes_exactly_the_tokens_outside_the_band():
    # ratios 0.4 (below), 1.0, 1.9 (inside), 3.0 (above), all with A = -1 so no PPO clip hides
    # a gradient: kept tokens get d loss / d logprob = ratio / 4, masked ones 0.
    ratios = [0.4, 1.0, 1.9, 3.0]
    logprobs, generation, adv, mask = _one_token_per_sequence(
        [math.log(r) for r in ratios], [-1.0] * 4
    )
    loss, metrics = _loss(
        logprobs, generation, adv, mask, clip_ratio_high=10.0, off_policy=_mode("token_mask")
    )
    assert loss.item() == pytest.approx((1.0 + 1.9) / 4, rel=1e-5)  # denominator stays 4
    loss.backward()
    torch.testing.assert_close(
        logprobs.grad[:, 1], torch.tensor([0.0, 1.0, 1.9, 0.0]) / 4, rtol=1e-5, atol=1e-7
    )
    assert metrics["importance_ratio/max"] == pytest.approx(3.0, rel=1e-5)  # uncorrected


_WIDE_CLIP = {"clip_ratio_low": 0.9, "clip_ratio_high": 10.0}


def _two_episodes():
    """Episode 0: token log-ratios 0.2, 1.0 (geometric-mean ratio e^0.6 = 1.82); episode 1:
    0.0, -2.0 (e^-1 = 0.37). A = -1 for both and the clip set at [0.1, 11] (`_WIDE_CLIP`), so
    the PPO clip never removes a gradient."""
    engine = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    logprobs = (engine + torch.tensor([[0.0, 0.2, 1.0], [0.0, 0.0, -2.0]])).requires_grad_()
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    return logprobs, engine, torch.tensor([-1.0, -1.0]), mask


def test_sequence_truncate_gives_every_token_the_capped_geometric_mean():
    logprobs, engine, adv, mask = _two_episodes()
    loss, _ = _loss(
        logprobs,
        engine,
        adv,
        mask,
        off_policy=_mode("sequence_truncate", high=1.5),
        **_WIDE_CLIP,
    )
    # Episode 0: e^0.6 capped at 1.5 for both tokens; episode 1: e^-1 (below the cap).
    per_token = [1.5, 1.5, math.exp(-1), math.exp(-1)]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[0.0, 1.5, 1.5], [0.0, math.exp(-1), math.exp(-1)]]) / 4
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-7)


def test_sequence_mask_removes_the_episodes_outside_the_band():
    logprobs, engine, adv, mask = _two_episodes()
    loss, metrics = _loss(
        logprobs,
        engine,
        adv,
        mask,
        off_policy=_mode("sequence_mask", low=0.5, high=2.0),
        **_WIDE_CLIP,
        agents=["kept", "dropped"],
    )
    assert loss.item() == pytest.approx(2 * math.exp(0.6) / 4, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[0.0, math.exp(0.6), math.exp(0.6)], [0.0, 0.0, 0.0]]) / 4
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-7)
    figures = finish_agent_statistics(metrics)
    assert figures["dropped"]["masked_share"] == 1.0 and figures["kept"]["masked_share"] == 0.0


def test_agent_statistics_by_hand_and_across_micro_batches():
    logprobs, engine, adv, mask = _two_episodes()
    agents = ["a", "b"]
    settings = {"off_policy": _mode("token_truncate", high=2.0), "agents": agents}
    _, metrics = _loss(logprobs, engine, adv, mask, **settings)
    figures = finish_agent_statistics(metrics)
    ratios_a = [math.exp(0.2), math.exp(1.0)]
    assert figures["a"]["logprob_diff/mean"] == pytest.approx(0.6)
    assert figures["a"]["logprob_diff/max"] == pytest.approx(1.0)
    assert figures["a"]["ratio/mean"] == pytest.approx(sum(ratios_a) / 2)
    assert figures["a"]["ratio/std"] == pytest.approx(abs(ratios_a[1] - ratios_a[0]) / 2)
    assert figures["a"]["capped_share"] == 0.5  # e^1 = 2.72 > 2
    assert figures["b"]["ratio/min"] == pytest.approx(math.exp(-2.0))
    assert figures["b"]["logprob_diff/mean"] == pytest.approx(1.0)
    parts = [
        _loss(
            logprobs[i : i + 1],
            engine[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            off_policy=settings["off_policy"],
            agents=agents[i : i + 1],
        )[1]
        for i in range(2)
    ]
    assert finish_agent_statistics(merge_agent_statistics(parts)) == figures


def test_mode_none_trains_on_policy_whatever_the_engine_said():
    logprobs, engine, adv, mask = _two_episodes()
    loss, metrics = _loss(logprobs, engine, adv, mask, off_policy=ON_POLICY, agents=["a", "b"])
    assert loss.item() == pytest.approx(1.0)  # ratio 1, A = -1
    assert metrics["importance_ratio/mean"] == 1.0
    # The trainer-engine figures still compare with the engine.
    assert finish_agent_statistics(metrics)["a"]["logprob_diff/max"] == pytest.approx(1.0)
