"""The torch trainer with `trainer.lora`: PEFT's adapter trains, the base stays as it was, the KL
anchor is the base, and checkpoints are PEFT's own format."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from gymrl.algo.loss import sequence_logprobs
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import LoraConfig, TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.loading import build_tiny_llama
from gymrl.run.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from gymrl.run.checkpoint import MODEL_FILE
from gymrl.trainer.grpo_step import micro_batch_loss
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

LORA = LoraConfig(enabled=True, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _model(tokenizer):
    return build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0
    )


def _trainer(tokenizer, lora=LORA, kl_coef=0.0):
    config = TorchTrainerConfig(
        micro_batch_size=8,
        prefix_packing=False,
        optimizer=TorchOptimizerConfig(lr=1e-2),
        lora=lora,
    )
    return TorchPolicyTrainer(
        _model(tokenizer),
        config,
        LossConfig(kl_coef=kl_coef),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=2,
        compute_dtype="float32",
    )


def _trajectory(model, prompt, generation, reward):
    """On-policy for `model`: its own log-probabilities as the generation's."""
    ids = torch.tensor([prompt + generation])
    mask = [0] * len(prompt) + [1] * len(generation)
    with torch.no_grad():
        logprobs = sequence_logprobs(model(input_ids=ids).logits, ids, 1.0)[0].tolist()
    logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
    return Trajectory(prompt + generation, mask, logprobs, reward, "agent", "g", 0)


def _sequence_logprob(model, trajectory):
    ids = torch.tensor([trajectory.token_ids])
    with torch.no_grad():
        logprobs = sequence_logprobs(model(input_ids=ids).logits, ids, 1.0)[0]
    return float((logprobs * torch.tensor(trajectory.loss_mask)).sum())


def _pair(model):
    good = _trajectory(model, [5, 6, 7, 8], [100, 101, 102], reward=1.0)
    bad = _trajectory(model, [5, 6, 7, 8], [200, 201, 202], reward=0.0)
    return [good, bad], torch.tensor([1.0, -1.0])


def test_only_the_adapter_trains_and_moves_the_policy_the_right_way(tokenizer):
    trainer = _trainer(tokenizer)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    adapter = {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert optimized == adapter and len(adapter) == 2 * 3 * 2  # A and B, 3 modules, 2 layers

    (good, bad), advantages = _pair(trainer.model)
    before = _sequence_logprob(trainer.model, good), _sequence_logprob(trainer.model, bad)
    metrics = trainer.train_step([good, bad], advantages)
    after = _sequence_logprob(trainer.model, good), _sequence_logprob(trainer.model, bad)
    assert after[0] > before[0] and after[1] < before[1] and metrics["grad_norm"] > 0
    for name, parameter in trainer.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(parameter, base[name]), name
            assert parameter.grad is None, name


def test_the_kl_anchor_is_the_base_model_with_the_adapter_disabled(tokenizer):
    """After a step the adapter has moved; the next step's KL term is measured against the
    untouched base, here a model built separately from the same seed."""
    trainer = _trainer(tokenizer, kl_coef=0.1)
    trajectories, advantages = _pair(trainer.model)
    assert trainer.train_step(trajectories, advantages)["kl"] == 0.0  # B = 0: policy = base
    trajectories, advantages = _pair(trainer.model)
    batch = collate(trajectories, advantages=advantages, pad_token_id=0)
    with torch.no_grad():
        policy = trainer._logprobs(trainer.model, batch, None)
        reference = trainer._logprobs(_model(tokenizer), batch, None)
    _, expected = micro_batch_loss(
        policy,
        batch,
        LossConfig(kl_coef=0.1),
        normalizer=6.0,
        agents=["agent", "agent"],
        reference_logprobs=reference,
    )
    metrics = trainer.train_step(trajectories, advantages)
    assert expected["kl"] > 0
    assert metrics["kl"] == pytest.approx(expected["kl"], rel=1e-5)


def test_a_checkpoint_is_the_adapter_in_pefts_format(tokenizer, tmp_path):
    trainer = _trainer(tokenizer)
    trainer.train_step(*_pair(trainer.model))
    path = trainer.save_checkpoint(tmp_path, step=1, data_state={})
    assert not (path / MODEL_FILE).exists()
    config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert len(load_file(path / ADAPTER_WEIGHTS_FILE)) == 12
    # PEFT itself loads it onto a fresh base and computes what the trainer's model does.
    loaded = PeftModel.from_pretrained(_model(tokenizer), str(path)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 100, 101]])
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected)


def test_a_checkpoint_of_another_kind_or_shape_is_refused_by_name(tokenizer, tmp_path):
    full = _trainer(tokenizer, lora=LoraConfig())
    full_path = full.save_checkpoint(tmp_path / "full", step=1, data_state={})
    with pytest.raises(ValueError, match="holds every weight and this trainer trains LoRA"):
        _trainer(tokenizer).load_checkpoint(full_path)
    lora_path = _trainer(tokenizer).save_checkpoint(tmp_path / "lora", step=1, data_state={})
    with pytest.raises(ValueError, match="holds an adapter and this trainer trains every weight"):
        _trainer(tokenizer, lora=LoraConfig()).load_checkpoint(lora_path)
    other = LORA.model_copy(update={"rank": 8})
    with pytest.raises(ValueError, match=r"'r': \(4, 8\)"):
        _trainer(tokenizer, lora=other).load_checkpoint(lora_path)


def test_a_lora_trainer_refits_its_adapter_not_its_state_dict(tokenizer):
    trainer = _trainer(tokenizer)
    with pytest.raises(TypeError, match="refits the adapter alone"):
        trainer.export_weights()
    adapter = trainer.export_adapter()
    assert adapter.scaling == 2.0 and len(adapter.module_pairs()) == 6
    assert all(t.device.type == "cpu" for t in adapter.tensors.values())
