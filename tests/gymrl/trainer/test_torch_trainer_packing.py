"""Prefix packing in the torch trainer: the same log-probabilities and gradients as padding.

The batch has what a GRPO step brings: groups sharing a system prompt and a question, identical
episodes, one episode a prefix of another, a multi-turn episode (a prompt delta between two
generations), a tail segment, an episode sharing nothing, and a masked sample."""

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.loading import build_tiny_llama
from gymrl.trainer.prefix_packing import PrefixTree, pack_prefix_tree
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

SYSTEM = list(range(3, 13))


def _model(attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    # Large initial weights: attention is far from uniform and rotary positions matter, so a
    # wrong mask or position moves the log-probabilities well past the tolerances below.
    model = build_tiny_llama(
        64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        seed=0,
        max_position_embeddings=64,
        initializer_range=0.3,
        pad_token_id=0,
    )
    model.set_attn_implementation(attn_implementation)
    return model


def _episode(segments, group="g", segment=0):
    """A trajectory from (tokens, generated) pieces; generated tokens at log-probability -1."""
    ids, mask = [], []
    for tokens, generated in segments:
        ids += tokens
        mask += [int(generated)] * len(tokens)
    logprobs = [-1.0 * m for m in mask]
    return Trajectory(ids, mask, logprobs, 1.0, "agent", group, 0, segment=segment)


def _batch() -> tuple[list[Trajectory], torch.Tensor]:
    a, b = [*SYSTEM, 20, 21, 22], [*SYSTEM, 30, 31]
    trajectories = [
        _episode([(a, False), ([40, 41, 42], True)], "a"),
        _episode([(a, False), ([40, 43], True)], "a"),  # shares a's first generated token
        _episode([(a, False), ([44, 45, 46, 47], True)], "a"),
        _episode([(a, False), ([44, 45, 46, 47], True)], "a"),  # identical to the one before
        _episode([(b, False), ([50, 51], True), ([25, 26], False), ([52, 53], True)], "b"),
        _episode([(b, False), ([50, 51], True)], "b"),  # a prefix of the multi-turn one
        Trajectory([], [], [], 0.0, "agent", "b", 0),  # masked: in the baseline, not the loss
        _episode([([*SYSTEM, 30, 31, 50, 51, 25, 26], False), ([54, 55], True)], "b", segment=1),
        _episode([([60, 61, 62], False), ([33, 34, 35], True)], "c"),  # nothing shared
    ]
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5, 0.0, -1.0, 0.75])
    return trajectories, advantages


def _trainer(model, compute_dtype="float32", loss=None, **config) -> TorchPolicyTrainer:
    return TorchPolicyTrainer(
        model,
        TorchTrainerConfig(optimizer=TorchOptimizerConfig(lr=1e-2), **config),
        loss or LossConfig(),
        temperature=0.7,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype=compute_dtype,
    )


def _padded_and_packed(trainer, model, tree_of=pack_prefix_tree):
    """`trainer`'s log-probabilities of the batch's trainable episodes, padded and packed."""
    trajectories, advantages = _batch()
    kept = [i for i, t in enumerate(trajectories) if not t.is_masked]
    chosen = [trajectories[i] for i in kept]
    batch = collate(chosen, advantages=advantages[kept], pad_token_id=0)
    tree = tree_of([t.token_ids for t in chosen])
    with torch.no_grad():
        padded = trainer._logprobs(model, batch, None)
        packed = trainer._logprobs(model, batch, tree)
    return padded, packed, batch["loss_mask"].bool()


def test_packed_log_probabilities_equal_the_padded_ones():
    model = _model()
    padded, packed, mask = _padded_and_packed(_trainer(model), model)
    assert bool((padded[mask] < -0.1).all())  # real log-probabilities, not zeros
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert bool((packed[~mask] == 0).all())


def test_packed_log_probabilities_in_bfloat16_stay_within_its_rounding():
    model = _model()
    padded, packed, _ = _padded_and_packed(_trainer(model, "bfloat16"), model)
    torch.testing.assert_close(packed, padded, rtol=0.0, atol=0.05)


def _siblings_visible(sequences):
    """The tree with every node seeing every node before it (siblings' branches included)."""
    tree = pack_prefix_tree(sequences)
    return dataclasses.replace(tree, subtree_end=torch.full_like(tree.subtree_end, tree.num_nodes))


def _positions_in_the_pack(sequences):
    """The tree with each node at its index in the packed sequence instead of its depth."""
    tree = pack_prefix_tree(sequences)
    return dataclasses.replace(tree, positions=torch.arange(tree.num_nodes))


@pytest.mark.parametrize("corrupt", [_siblings_visible, _positions_in_the_pack])
def test_a_mask_showing_siblings_or_wrong_positions_would_fail_the_equality(corrupt):
    """The equality above has teeth: a tree whose tokens see a sibling branch, or sit at their
    packed index rather than their depth, moves the log-probabilities far past its tolerance."""
    model = _model()
    padded, packed, mask = _padded_and_packed(_trainer(model), model, corrupt)
    assert float((packed - padded)[mask].abs().max()) > 1e-2


def _step_gradients(trainer, trajectories, advantages):
    """The gradients `train_step` hands the optimizer, and its metrics."""
    captured = {}

    def capture():
        for name, parameter in trainer.model.named_parameters():
            captured[name] = parameter.grad.clone()

    trainer.optimizer.step = capture
    metrics = trainer.train_step(trajectories, advantages)
    return captured, metrics


@pytest.mark.parametrize(
    ("packing", "loss"),
    [
        ({"max_packed_tokens": 256}, LossConfig()),  # the whole step in one tree
        ({"max_packed_tokens": 1}, LossConfig()),  # one sequence per micro-batch
        ({"max_packed_tokens": 30}, LossConfig(token_level_normalization=False)),
        ({"max_packed_tokens": 256}, LossConfig(kl_coef=0.5)),
    ],
    ids=["one-tree", "single-sequences", "per-sequence-mean", "kl"],
)
def test_a_packed_step_has_the_padded_steps_gradients(packing, loss):
    model = _model()
    padded = _trainer(copy.deepcopy(model), loss=loss, prefix_packing=False, micro_batch_size=3)
    packed = _trainer(copy.deepcopy(model), loss=loss, prefix_packing=True, **packing)
    if loss.kl_coef:  # a reference away from the policy, so the KL term has a gradient
        reference = _model()
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.mul_(0.9)
        for trainer in (padded, packed):
            trainer._reference = copy.deepcopy(reference).requires_grad_(False)
    trajectories, advantages = _batch()
    want, want_metrics = _step_gradients(padded, trajectories, advantages)
    got, got_metrics = _step_gradients(packed, trajectories, advantages)
    assert want_metrics["grad_norm"] > 0
    for name, gradient in want.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    if loss.kl_coef:
        assert want_metrics["kl"] > 1e-3


def test_sequences_packed_alone_build_no_square_mask_and_keep_the_padded_gradients(
    monkeypatch,
):
    """A sequence longer than max_packed_tokens is packed alone; its tree is a chain, so plain
    causal attention computes it without the [N, N] mask (10^9 entries at 32k tokens)."""
    model = _model()
    padded = _trainer(copy.deepcopy(model), prefix_packing=False, micro_batch_size=3)
    packed = _trainer(copy.deepcopy(model), prefix_packing=True, max_packed_tokens=1)
    trajectories, advantages = _batch()
    want, _ = _step_gradients(padded, trajectories, advantages)

    def refuse(tree):
        raise AssertionError(f"a dense [{tree.num_nodes}, {tree.num_nodes}] mask was built")

    monkeypatch.setattr(PrefixTree, "visible", refuse)
    got, _ = _step_gradients(packed, trajectories, advantages)
    for name, gradient in want.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_only_a_single_path_counts_as_a_chain():
    assert pack_prefix_tree([[1, 2, 3]]).is_chain()
    assert pack_prefix_tree([[1, 2], [1, 2, 3, 4], [1, 2, 3]]).is_chain()  # nested prefixes
    assert not pack_prefix_tree([[1, 2, 3], [1, 2, 4]]).is_chain()
    assert not pack_prefix_tree([[1, 2], [3, 4]]).is_chain()


@pytest.mark.parametrize("attention", ["flash_attention_2", "eager"])
def test_packing_refuses_attention_that_ignores_the_mask_or_holds_n_by_n_scores(attention):
    """Flash attention would ignore the tree's mask; eager holds every head's N x N scores even
    for a long episode packed alone, so packing's memory bound would not hold."""
    model = _model()
    model.config._attn_implementation = attention  # flash-attn itself is not installed here
    with pytest.raises(ValueError, match=rf"attn_implementation is '{attention}'.*sdpa"):
        _trainer(model, prefix_packing=True)
    _trainer(model, prefix_packing=False)  # padding needs no custom mask
