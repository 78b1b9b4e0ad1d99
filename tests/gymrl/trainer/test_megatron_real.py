"""The Megatron trainer on the real megatron-core and Megatron-Bridge (`make megatron-venv`).

On CUDA where there is one (`launch/gpu_check/run.sh`), else on the CPU over gloo through the
CPU device shim `cpu_standins/megatron_trainer/megatron_on_cpu.py`. A generated tiny Llama with
grouped-query attention (4 heads, 2 KV heads, SmolLM2's vocabulary) stands in for the policy.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from gymrl.config.schema.grpo import ParityGateConfig
from gymrl.trainer.megatron.arguments import (
    ddp_config_kwargs,
    optimizer_config_kwargs,
    parallel_state_kwargs,
    provider_overrides,
    scheduler_kwargs,
)
from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
from gymrl.trainer.parity_gate import ParityCheck, ParityGateError
from tests.gymrl.trainer.fixed_trajectories import fixed_trajectory
from tests.gymrl.trainer.megatron_setup import (
    DEVICE,
    in_process_rank,
    megatron_batch,
    tensor_parallel_run,
    tiny_config,
)

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def tiny_trainer(megatron_runtime, tiny_llama):
    folder, hf_model = tiny_llama
    with in_process_rank():
        yield MegatronPolicyTrainer(tiny_config(folder), temperature=0.8), folder, hf_model


def test_megatron_logprobs_match_hugging_face(tiny_trainer):
    from gymrl.algo.loss import sequence_logprobs

    trainer, _, hf_model = tiny_trainer
    trajectories, _ = megatron_batch(hf_model.config.vocab_size)
    got = trainer.compute_logprobs(trajectories)
    hf_model = hf_model.to(DEVICE).eval()
    for index, trajectory in enumerate(trajectories):
        ids = torch.tensor([trajectory.token_ids], device=DEVICE)
        with torch.no_grad():
            expected = sequence_logprobs(hf_model(ids).logits, ids, temperature=0.8)[0]
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(got[index])[mask], expected.cpu()[mask], rtol=0, atol=2e-3
        )


def test_megatron_export_names_and_values_are_the_hugging_face_checkpoints(tiny_trainer):
    """Before any step, `export_weights` gives back exactly the checkpoint it loaded: every
    Hugging Face name (tied embeddings: no separate lm_head), every value bit-equal in fp32."""
    trainer, _, hf_model = tiny_trainer
    if trainer.weight_version:
        pytest.skip("runs on the untrained model only (run the module in order)")
    exported = trainer.export_weights()
    expected = {name: tensor for name, tensor in hf_model.state_dict().items()}
    expected.pop("lm_head.weight")  # tied to the embedding
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name].cpu(), tensor.cpu()), name


def test_megatron_exported_weights_do_not_change_under_later_steps(tiny_trainer):
    """An exported dict is a snapshot: a later optimizer step must not write into it (on a CPU
    Bridge hands back the live parameters of weights it maps one to one)."""
    trainer, _, hf_model = tiny_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    exported = trainer.export_weights()
    snapshot = {name: tensor.clone() for name, tensor in exported.items()}
    trainer.train_step(trajectories, advantages)
    changed = [name for name in snapshot if not torch.equal(exported[name], snapshot[name])]
    assert changed == []


def test_megatron_train_step(tiny_trainer):
    trainer, _, hf_model = tiny_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    before = trainer.export_weights()
    version = trainer.weight_version
    metrics = trainer.train_step(trajectories, advantages)
    assert metrics["num_tokens"] == sum(t.num_generated_tokens for t in trajectories)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["num_sequences"] == len(trajectories) and metrics["lr"] == 1e-3
    assert trainer.weight_version == version + 1
    after = trainer.export_weights()
    assert all(not torch.equal(before[name], after[name]) for name in before)


def test_megatron_parity_stop_leaves_the_weights_and_the_next_step_trains(tiny_trainer):
    """The first step's gate with `on_failure: stop`: engine log-probabilities far from the
    trainer's (megatron_batch's -3.0 per token) stop the step before the update, on every rank
    alike; the weights and the version stay, and the next step trains from them with no
    gradient left over from the stopped one."""
    trainer, _, hf_model = tiny_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    before, version = trainer.export_weights(), trainer.weight_version
    check = ParityCheck(ParityGateConfig(on_failure="stop"), "float32")
    with pytest.raises(ParityGateError, match=r"a: logprob_diff/mean = [0-9.]+ > "):
        trainer.train_step(trajectories, advantages, check)
    after = trainer.export_weights()
    assert trainer.weight_version == version
    assert all(torch.equal(before[name], after[name]) for name in before)
    stepped = trainer.train_step(trajectories, advantages)
    assert trainer.weight_version == version + 1 and math.isfinite(stepped["grad_norm"])
    repeated = trainer.train_step(trajectories, advantages)
    # The stopped step left no gradient behind: the step after it is an ordinary one.
    assert stepped["loss"] != repeated["loss"] and trainer.weight_version == version + 2


def test_megatron_resumed_step_equals_the_uninterrupted_one(tiny_trainer, tmp_path):
    """Save, step (the uninterrupted run), step again, load, step: the resumed step gives the
    uninterrupted one's metrics and weights, bit for bit on the CPU (weights, Adam's moments and
    step count, the scheduler and the RNG all come back through `dist_checkpointing`)."""
    trainer, _, hf_model = tiny_trainer
    trajectories, advantages = megatron_batch(hf_model.config.vocab_size)
    # Megatron's optimizer without Transformer Engine or Apex saves its state only once it has
    # one (`distrib_optimizer.py` state_dict asserts on the steps taken); runs save after steps.
    trainer.train_step(trajectories, advantages)
    version = trainer.weight_version
    checkpoint = trainer.save_checkpoint(tmp_path / "ckpt", 1, {"position": 7})
    saved = trainer.export_weights()
    uninterrupted = trainer.train_step(trajectories, advantages)
    expected = trainer.export_weights()
    trainer.train_step(trajectories, advantages)

    state = trainer.load_checkpoint(checkpoint)
    assert state["step"] == 1 and state["data_state"] == {"position": 7}
    assert state["weight_version"] == version == trainer.weight_version
    restored = trainer.export_weights()
    assert [name for name in saved if not torch.equal(saved[name], restored[name])] == []
    resumed_metrics = trainer.train_step(trajectories, advantages)
    resumed = trainer.export_weights()
    if DEVICE == "cpu":
        assert resumed_metrics == uninterrupted
        assert [name for name in expected if not torch.equal(expected[name], resumed[name])] == []
    else:  # CUDA's atomic adds (the embedding's backward among them) may reorder sums
        assert resumed_metrics == pytest.approx(uninterrupted, rel=1e-5)
        for name, tensor in expected.items():
            torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-7)


def test_megatron_hf_checkpoint_reloads_in_transformers(tiny_trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, _, _ = tiny_trainer
    weights = trainer.export_weights()
    exported = trainer.export_hf_checkpoint(tmp_path / "hf" / "v1")
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    state = reloaded.state_dict()
    assert set(weights) <= set(state)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor.cpu()), name


def test_megatron_skips_a_step_without_generated_tokens(tiny_trainer):
    trainer, _, _ = tiny_trainer
    masked = [fixed_trajectory(3, 0)]
    assert trainer.train_step(masked, torch.zeros(1)) == {"num_tokens": 0.0, "num_sequences": 0.0}


def test_megatron_arguments_bind_to_the_real_signatures(megatron_runtime, swe_config):
    """Every argument dict the trainer builds binds to what megatron-core really takes, so a
    renamed or misspelt keyword fails here rather than on a cluster."""
    import dataclasses
    import inspect

    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    no_recompute = swe_config.model_copy(
        update={
            "trainer": swe_config.trainer.model_copy(update={"activation_checkpointing": False})
        }
    )
    for config in (swe_config, no_recompute):
        trainer = config.trainer
        inspect.signature(parallel_state.initialize_model_parallel).bind(
            **parallel_state_kwargs(trainer)
        )
        inspect.signature(DistributedDataParallelConfig).bind(**ddp_config_kwargs(trainer))
        inspect.signature(OptimizerConfig).bind(**optimizer_config_kwargs(config))
        inspect.signature(OptimizerParamScheduler).bind(object(), **scheduler_kwargs(config))
        # The GPT provider is a TransformerConfig dataclass with GPT fields (`seq_length`); the
        # overrides are set on it as attributes.
        fields = {field.name for field in dataclasses.fields(GPTModelProvider)}
        assert set(provider_overrides(config)) <= fields, set(provider_overrides(config)) - fields
        inspect.signature(GPTModelProvider).bind_partial(**provider_overrides(config))


def test_megatron_provider_overrides_are_fields_of_the_bridge_provider(tiny_trainer):
    """The overrides land on Megatron-Bridge's provider class of a real model, not only on the
    base TransformerConfig."""
    import dataclasses

    from megatron.bridge import AutoBridge

    trainer, folder, _ = tiny_trainer
    provider = AutoBridge.from_hf_pretrained(str(folder)).to_megatron_provider(load_weights=False)
    fields = {field.name for field in dataclasses.fields(provider)}
    overrides = provider_overrides(trainer._config)
    assert set(overrides) <= fields, set(overrides) - fields


# ------------------------------------------------------------------------ more than one rank
def _need_devices(count: int) -> None:
    """On the CPU any number of ranks run; on CUDA each needs a GPU of its own."""
    if torch.cuda.is_available() and torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs, this machine has {torch.cuda.device_count()}")


def _spawn_run(tmp_path_factory, folder, *, tp: int, world_size: int) -> dict:
    from nemo_gym_ext.ports import free_port

    _need_devices(world_size)
    out = tmp_path_factory.mktemp(f"tp{tp}") / "run.pt"
    torch.multiprocessing.spawn(
        tensor_parallel_run,
        args=(world_size, tp, str(folder), free_port(), str(out)),
        nprocs=world_size,
        join=True,
    )
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tp1_run(megatron_runtime, tiny_llama, tmp_path_factory):
    """The reference: one rank, TP 1, in a process of its own."""
    return _spawn_run(tmp_path_factory, tiny_llama[0], tp=1, world_size=1)


def test_megatron_tensor_parallel_2_equals_tp_1(tp1_run, tiny_llama, tmp_path_factory):
    """TP 2 (2 of 4 heads and 1 of 2 KV heads per rank, half the MLP and half the vocabulary)
    against TP 1 on the same batch, in fp32, where only the order of the sums differs:
    log-probabilities within 1e-5, the step's loss and gradient norm within 1e-5 relative,
    every element of every gradient and every updated weight within 1e-4 relative or 1e-6
    absolute (seen: 3e-5 relative, 2e-7 absolute, on one of the embedding's 3.1M gradients)."""
    tp2 = _spawn_run(tmp_path_factory, tiny_llama[0], tp=2, world_size=2)
    assert sorted(tp2["logprobs"]) == sorted(tp1_run["logprobs"])
    for index, expected in tp1_run["logprobs"].items():
        torch.testing.assert_close(
            torch.tensor(tp2["logprobs"][index]), torch.tensor(expected), rtol=0, atol=1e-5
        )
    for key in ("loss", "grad_norm", "num_tokens", "num_sequences"):
        assert tp2["metrics"][key] == pytest.approx(tp1_run["metrics"][key], rel=1e-5), key
    for kind in ("gradients", "weights"):
        assert sorted(tp2[kind]) == sorted(tp1_run[kind])
        for name, expected in tp1_run[kind].items():
            torch.testing.assert_close(tp2[kind][name], expected, rtol=1e-4, atol=1e-6)


def test_megatron_trainer_group_on_ray_with_two_ranks(tp1_run, tiny_llama):
    """`MegatronTrainerGroup` with two data-parallel ranks as Ray actors on the driver's Ray:
    the batch split over the ranks gives the one-rank run's log-probabilities, loss, gradient
    norm and updated weights (Megatron's DP averaging undone by `megatron_loss_scale`)."""
    import os

    ray = pytest.importorskip("ray")  # absent on the GPU check's machine (docs/cluster.md)
    from ray.util.placement_group import placement_group

    from gymrl.cluster.placement import plan_placement
    from gymrl.trainer.megatron.group import MegatronTrainerGroup

    _need_devices(2)
    folder, _ = tiny_llama
    config = tiny_config(folder, ranks=2)
    ranks = plan_placement(config).trainer
    assert len(ranks.bundle_of_actor) == 2
    # Every actor prepares its process as this one did (megatron_on_cpu.prepare_process).
    path = [os.getcwd(), os.environ.get("PYTHONPATH", "")]
    runtime_env = {
        "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, path))},
        "worker_process_setup_hook": (
            "cpu_standins.megatron_trainer.megatron_on_cpu.prepare_process"
        ),
    }
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, runtime_env=runtime_env)
    try:
        bundles = placement_group([{"GPU": 1.0, "CPU": 1.0}] * 2)
        ray.get(bundles.ready(), timeout=120)
        group = MegatronTrainerGroup(
            config,
            placement_group=bundles,
            ranks=replace(ranks, bundle_of_actor=(0, 1)),
            temperature=0.8,
            start_timeout_s=600,
            call_timeout_s=600,
        )
        trajectories, advantages = megatron_batch(tiny_llama[1].config.vocab_size)
        logprobs = group.compute_logprobs(trajectories)
        for index, expected in tp1_run["logprobs"].items():
            torch.testing.assert_close(
                torch.tensor(logprobs[index]), torch.tensor(expected), rtol=0, atol=1e-5
            )
        metrics = group.train_step(trajectories, advantages)
        for key in ("loss", "grad_norm", "num_tokens", "num_sequences"):
            assert metrics[key] == pytest.approx(tp1_run["metrics"][key], rel=1e-5), key
        weights = group.export_weights()
        assert sorted(weights) == sorted(tp1_run["weights"])
        for name, expected in tp1_run["weights"].items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=1e-6)
        group.shutdown()
    finally:
        ray.shutdown()
