"""LoRA in the Megatron trainer, through megatron-bridge's PEFT, on the real megatron-core and
Megatron-Bridge (`make megatron-venv`; the CPU over gloo where there is no CUDA).

The key check: the adapter the trainer exports (PEFT's format, Hugging Face names), merged into
the Hugging Face model by the torch engine's `update_adapter` (the adapter refit), gives the
log-probabilities the Megatron trainer computes with its adapter.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.run.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, AdapterWeights
from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
from tests.gymrl.trainer.megatron_setup import DEVICE, in_process_rank, megatron_batch, tiny_config

pytestmark = pytest.mark.megatron

RANK, ALPHA = 4, 8
LORA = [f"trainer.lora.rank={RANK}", f"trainer.lora.alpha={ALPHA}", "trainer.optimizer.lr=1e-2"]
ATOL = 1e-4 if DEVICE == "cpu" else 2e-3
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_trainer(megatron_runtime, tiny_llama):
    folder, hf_model = tiny_llama
    with in_process_rank():
        config = tiny_config(folder, lora=LORA)
        yield MegatronPolicyTrainer(config, temperature=0.8), config, hf_model


def _adapter_numel(hf_model) -> int:
    """Parameters of a rank-RANK adapter on every targeted Linear, counted as Megatron holds
    them: one A for q, k and v (linear_qkv) and one for gate and up (linear_fc1)."""
    total = 0
    for layer in hf_model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv_out = sum(
            m.out_features for m in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        total += RANK * (attention.q_proj.in_features + qkv_out)
        total += RANK * (attention.o_proj.in_features + attention.o_proj.out_features)
        total += RANK * (mlp.gate_proj.in_features + 2 * mlp.gate_proj.out_features)
        total += RANK * (mlp.down_proj.in_features + mlp.down_proj.out_features)
    return total


def test_only_the_adapter_trains_and_the_optimizer_holds_it_alone(lora_trainer):
    trainer, _, hf_model = lora_trainer
    trainable = {
        name: param
        for chunk in trainer._model
        for name, param in chunk.named_parameters()
        if param.requires_grad
    }
    assert trainable and all(".adapter." in name for name in trainable)
    assert sum(param.numel() for param in trainable.values()) == _adapter_numel(hf_model)
    optimized = sum(
        param.numel() for group in trainer._optimizer.param_groups for param in group["params"]
    )
    assert optimized == _adapter_numel(hf_model)

    frozen = {
        name: param.detach().clone()
        for chunk in trainer._model
        for name, param in chunk.named_parameters()
        if not param.requires_grad
    }
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    metrics = trainer.train_step(trajectories, advantages)
    assert metrics["grad_norm"] > 0
    after = {name: param for chunk in trainer._model for name, param in chunk.named_parameters()}
    assert [name for name, before in frozen.items() if not torch.equal(after[name], before)] == []


def test_the_adapter_exports_in_pefts_format_under_hugging_face_names(lora_trainer):
    trainer, config, hf_model = lora_trainer
    adapter = trainer.export_adapter()
    assert adapter.config["r"] == RANK and adapter.config["lora_alpha"] == ALPHA
    assert adapter.config["target_modules"] == sorted(HF_MODULES)
    assert adapter.scaling == ALPHA / RANK
    pairs = adapter.module_pairs()
    expected = {
        f"model.layers.{index}.{'mlp' if name in MLP_MODULES else 'self_attn'}.{name}"
        for index in range(hf_model.config.num_hidden_layers)
        for name in HF_MODULES
    }
    assert set(pairs) == expected
    modules = dict(hf_model.named_modules())
    for name, (a, b) in pairs.items():
        assert a.shape == (RANK, modules[name].in_features), name
        assert b.shape == (modules[name].out_features, RANK), name
    # It crosses Ray to processes without megatron: no tensor pickled through megatron-core's
    # storage unpickler (`megatron.core.safe_globals`).
    assert b"megatron" not in pickle.dumps(adapter)
    # linear_qkv's one A is q's, k's and v's.
    layer = "base_model.model.model.layers.0.self_attn"
    a = adapter.tensors[f"{layer}.q_proj.lora_A.weight"]
    assert torch.equal(a, adapter.tensors[f"{layer}.v_proj.lora_A.weight"])
    del config


def test_the_exported_adapter_merged_by_the_torch_engine_gives_megatrons_logprobs(
    lora_trainer,
):
    """Two steps move B away from zero; the adapter, exported and merged into a copy of the Hugging
    Face model by the torch engine's adapter refit, gives the log-probabilities Megatron computes
    through its unmerged adapter: to 1e-4 on the CPU in fp32 (measured: 1e-6), to 2e-3 on CUDA
    (the tolerance of the base model's own Megatron-against-transformers check,
    test_megatron_real.py); and they are not the base model's (0.13-0.17 apart), so the check
    would catch an adapter that did not arrive."""
    from gymrl.algo.loss import sequence_logprobs

    trainer, _, hf_model = lora_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    for _ in range(2):
        trainer.train_step(trajectories, advantages)
    got = trainer.compute_logprobs(trajectories)
    adapter = trainer.export_adapter()
    assert all(b.abs().max() > 0 for _, b in adapter.module_pairs().values())

    merged = _merged_logprobs(copy.deepcopy(hf_model), adapter, trajectories)
    base = hf_model.eval()
    moved = 0.0
    for index, trajectory in enumerate(trajectories):
        ids = torch.tensor([trajectory.token_ids])
        with torch.no_grad():
            original = sequence_logprobs(base(ids).logits, ids, temperature=0.8)[0]
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        megatron = torch.tensor(got[index])[mask]
        torch.testing.assert_close(megatron, merged[index][mask], rtol=0, atol=ATOL)
        moved = max(moved, float((megatron - original[mask]).abs().max()))
    assert moved > 2e-2


def test_a_lora_checkpoint_holds_the_adapter_in_pefts_format_and_resumes_exactly(
    lora_trainer, tmp_path
):
    """The checkpoint: PEFT's two files (the exported adapter, bit for bit) and a distributed
    checkpoint of the adapter and the optimizer alone, no base weight. Save, step (the
    uninterrupted run), step again, load, step: the resumed step gives the uninterrupted one's
    metrics and adapter, bit for bit on the CPU."""
    trainer, _, hf_model = lora_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    trainer.train_step(trajectories, advantages)
    checkpoint = Path(trainer.save_checkpoint(tmp_path / "ckpt", 3, {"position": 2}))
    saved = trainer.export_adapter()
    on_disk = AdapterWeights.read(checkpoint)
    assert on_disk.config == json.loads(json.dumps(saved.config))
    assert sorted(on_disk.tensors) == sorted(saved.tensors)
    assert all(torch.equal(on_disk.tensors[k], saved.tensors[k]) for k in saved.tensors)
    assert (checkpoint / ADAPTER_WEIGHTS_FILE).is_file()
    # Megatron's shards hold the adapter and its optimizer state, not the base model.
    base_bytes = sum(t.numel() * t.element_size() for t in hf_model.state_dict().values())
    shard_bytes = sum(f.stat().st_size for f in (checkpoint / "megatron").rglob("*") if f.is_file())
    assert shard_bytes < base_bytes / 4

    uninterrupted = trainer.train_step(trajectories, advantages)
    expected = trainer.export_adapter()
    trainer.train_step(trajectories, advantages)
    state = trainer.load_checkpoint(checkpoint)
    assert state["step"] == 3 and state["data_state"] == {"position": 2}
    restored = trainer.export_adapter()
    assert all(torch.equal(restored.tensors[k], saved.tensors[k]) for k in saved.tensors)
    resumed = trainer.train_step(trajectories, advantages)
    after = trainer.export_adapter()
    if DEVICE == "cpu":
        assert resumed == uninterrupted
        assert [
            k for k in expected.tensors if not torch.equal(after.tensors[k], expected.tensors[k])
        ] == []
    else:
        assert resumed == pytest.approx(uninterrupted, rel=1e-5)


def test_a_lora_checkpoint_of_another_shape_or_a_full_one_is_refused_by_field(
    lora_trainer, tmp_path
):
    trainer, _, hf_model = lora_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    trainer.train_step(trajectories, advantages)
    checkpoint = Path(trainer.save_checkpoint(tmp_path / "ckpt", 1, {}))
    config_file = checkpoint / ADAPTER_CONFIG_FILE
    fields = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(fields | {"r": 8}))
    with pytest.raises(ValueError, match=re.escape("{'r': (8, 4)}")):
        trainer.load_checkpoint(checkpoint)
    config_file.unlink()
    with pytest.raises(ValueError, match="holds every weight and this trainer trains LoRA"):
        trainer.load_checkpoint(checkpoint)


def _merged_logprobs(model, adapter: AdapterWeights, trajectories) -> list[torch.Tensor]:
    """`adapter` merged into `model` (in place) by the torch engine's adapter refit, then each
    trajectory's log-probabilities through it."""
    from gymrl.algo.loss import sequence_logprobs
    from gymrl.generation.torch.engine import TorchGenerationEngine

    engine = TorchGenerationEngine.from_config(
        model,
        TorchGenerationConfig(max_batch_size=2, decode_path="transformers"),
        seed=0,
        compute_dtype="float32",
        eos_token_ids=(),
    )
    try:
        engine.update_adapter(adapter, version=1)
    finally:
        engine.close()
    found = []
    for trajectory in trajectories:
        ids = torch.tensor([trajectory.token_ids])
        with torch.no_grad():
            found.append(sequence_logprobs(model.eval()(ids).logits, ids, temperature=0.8)[0])
    return found


def test_an_adapter_trained_at_tensor_parallel_2_merges_to_megatrons_logprobs(
    megatron_runtime, tiny_llama, tmp_path
):
    """TP 2 (each rank holding half of every adapted weight's outputs or inputs): the adapter
    gathered over the ranks, merged into the Hugging Face model by the torch engine, gives the
    log-probabilities Megatron computes at TP 2."""
    from nemo_gym_ext.ports import free_port
    from tests.gymrl.trainer.megatron_setup import tensor_parallel_lora_run

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    folder, hf_model = tiny_llama
    out = tmp_path / "run.pt"
    torch.multiprocessing.spawn(
        tensor_parallel_lora_run,
        args=(2, str(folder), LORA, free_port(), str(out)),
        nprocs=2,
        join=True,
    )
    seen = torch.load(out, weights_only=False)
    adapter = AdapterWeights(seen["config"], seen["tensors"])
    assert len(adapter.module_pairs()) == len(HF_MODULES) * hf_model.config.num_hidden_layers
    trajectories, _ = megatron_batch(hf_model.config.vocab_size)
    merged = _merged_logprobs(copy.deepcopy(hf_model), adapter, trajectories)
    for index, trajectory in enumerate(trajectories):
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        megatron = torch.tensor(seen["logprobs"][index])[mask]
        torch.testing.assert_close(megatron, merged[index][mask], rtol=0, atol=ATOL)


def test_an_attention_adapter_on_the_tiny_moe_at_expert_parallel_2_merges_to_megatrons_logprobs(
    megatron_runtime, tiny_moe_dir, tmp_path
):
    """The MoE path (the flagship's at EP 2, two ranks): bridge's LoRA on attention alone, the
    experts frozen; the adapter gathered from the two ranks and merged by the torch engine into
    transformers' Qwen3-MoE gives the log-probabilities Megatron computes (routing included)."""
    from gymrl.model.loading import load_pretrained
    from nemo_gym_ext.ports import free_port
    from tests.gymrl.trainer.megatron_moe import expert_parallel_lora_run

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    out = tmp_path / "run.pt"
    torch.multiprocessing.spawn(
        expert_parallel_lora_run, args=(2, free_port(), str(out)), nprocs=2, join=True
    )
    seen = torch.load(out, weights_only=False)
    adapter = AdapterWeights(seen["config"], seen["tensors"])
    assert {name.rsplit(".", 1)[-1] for name in adapter.module_pairs()} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    model = load_pretrained(tiny_moe_dir, torch.float32)
    trajectories, _ = megatron_batch(model.config.vocab_size)
    merged = _merged_logprobs(model, adapter, trajectories)
    for index, trajectory in enumerate(trajectories):
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        megatron = torch.tensor(seen["logprobs"][index])[mask]
        torch.testing.assert_close(megatron, merged[index][mask], rtol=0, atol=ATOL)
