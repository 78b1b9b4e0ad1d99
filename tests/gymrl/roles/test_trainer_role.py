"""The torch trainer role on a real local Ray, as the recipe drives it: a step, a refit into
the generation server's `update_weights`, a checkpoint round trip, and close."""

import time

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from gymrl.algo.trajectory import Trajectory
from gymrl.cluster.placement import plan_placement, reserve
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from gymrl.roles.trainer import TorchTrainerRole, start_trainer
from gymrl.run.checkpoint import latest_checkpoint


@pytest.fixture(scope="module")
def config():
    return validate_config(compose_raw(["+experiment=smoke"]))


pytestmark = pytest.mark.usefixtures("local_ray")


ROUNDED = "model.layers.0.self_attn.q_proj.weight"  # stored in bfloat16 by this engine


@ray.remote(num_cpus=0)
class RecordingGeneration:
    """The generation server's refit verbs, recording what the trainer sent."""

    def __init__(self):
        self.refits = []
        self.dtype_questions = 0

    def weight_dtypes(self):
        self.dtype_questions += 1
        return {ROUNDED: torch.bfloat16}

    def asked(self):
        return self.dtype_questions

    def update_weights(self, state_dict, version):
        self.refits.append((version, {name: t.clone() for name, t in state_dict.items()}))
        return version

    def update_adapter(self, adapter, version):
        self.refits.append((version, adapter))
        return version

    def received(self):
        return self.refits


def _batch():
    trajectories = [
        Trajectory(
            token_ids=[5, 6, 7, 8 + index, 9 + index],
            loss_mask=[0, 0, 0, 1, 1],
            generation_logprobs=[0.0, 0.0, 0.0, -2.0, -2.0],
            reward=float(index),
            agent="calculator_agent",
            group_id="g",
            weight_version=0,
        )
        for index in range(2)
    ]
    return trajectories, torch.tensor([-1.0, 1.0])


def _start_torch_role(config, tmp_path, closers: list):
    """The torch trainer of `config` at one thread in a placement group of its own; its
    registered closers appended to `closers` as (what, close)."""
    placement = plan_placement(config)
    return start_trainer(
        config,
        tmp_path,
        torch_threads=1,
        placement=placement,
        group=reserve(placement, 30),
        on_cleanup=lambda what, close: closers.append((what, close)),
    )


def test_torch_role_trains_refits_checkpoints_and_closes(config, tmp_path):
    closers = []
    role = _start_torch_role(config, tmp_path, closers)
    assert isinstance(role, TorchTrainerRole)
    assert closers == [("the trainer", role.close)]
    role.wait_until_started()
    generation = RecordingGeneration.remote()

    role.refit(generation, 0)
    metrics = role.train_step(*_batch())
    assert metrics["num_tokens"] == 4.0 and metrics["grad_norm"] > 0
    role.refit(generation, 1)
    (v0, before), (v1, after) = ray.get(generation.received.remote())
    assert (v0, v1) == (0, 1) and before.keys() == after.keys()
    # Sent in the engine's dtypes, asked once.
    assert after[ROUNDED].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for name, t in after.items() if name != ROUNDED)
    assert ray.get(generation.asked.remote()) == 1
    assert any(not torch.equal(before[name], after[name]) for name in before)

    role.save_checkpoint(tmp_path / "checkpoints", 1, {"position": 16})
    role.train_step(*_batch())
    state = role.load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert state["step"] == 1 and state["data_state"] == {"position": 16}
    role.refit(generation, 1)
    restored = ray.get(generation.received.remote())[-1][1]
    assert all(torch.equal(after[name], restored[name]) for name in after)

    actor = role._actor
    role.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            ray.get(actor.weight_version.remote(), timeout=2)
        except RayActorError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the trainer actor still answers after close()")


def test_a_lora_role_refits_the_adapter_alone_and_restores_it_from_its_checkpoint(tmp_path):
    lora = validate_config(compose_raw(["+experiment=smoke", "trainer.lora.enabled=true"]))
    closers = []
    role = _start_torch_role(lora, tmp_path, closers)
    try:
        role.wait_until_started()
        generation = RecordingGeneration.remote()
        role.refit(generation, 0)
        role.train_step(*_batch())
        role.refit(generation, 1)
        (v0, before), (v1, after) = ray.get(generation.received.remote())
        assert (v0, v1) == (0, 1) and ray.get(generation.asked.remote()) == 0
        assert after.config["r"] == 16 and after.tensors.keys() == before.tensors.keys()
        assert all(".lora_A." in key or ".lora_B." in key for key in after.tensors)
        assert any(not torch.equal(before.tensors[k], after.tensors[k]) for k in after.tensors)

        role.save_checkpoint(tmp_path / "checkpoints", 1, {"position": 16})
        role.train_step(*_batch())
        role.load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
        role.refit(generation, 1)
        restored = ray.get(generation.received.remote())[-1][1]
        assert all(torch.equal(after.tensors[k], restored.tensors[k]) for k in after.tensors)
    finally:
        role.close()


def test_torch_role_start_is_bounded_by_trainer_start_timeout_s(tmp_path):
    """The actor is launched at once (its model loads while the recipe starts other roles) and
    its closer registered then, so the recipe's cleanup ends a trainer that never started."""
    config = validate_config(compose_raw(["+experiment=smoke", "trainer.start_timeout_s=0.001"]))
    closers = []
    role = _start_torch_role(config, tmp_path, closers)
    assert closers == [("the trainer", role.close)]
    with pytest.raises(
        TimeoutError,
        match=r"starting the torch trainer \(trainer.start_timeout_s\) did not finish within "
        r"0.001 s",
    ):
        role.wait_until_started()
    role.close()


def test_megatron_role_waits_trainer_start_timeout_s_for_its_ranks(tmp_path, monkeypatch):
    """The group's constructor is where Megatron's ranks start (rendezvous, model load)."""
    import gymrl.trainer.megatron.group as megatron_group

    received = {}
    monkeypatch.setattr(
        megatron_group, "MegatronTrainerGroup", lambda config, **kwargs: received.update(kwargs)
    )
    config = validate_config(compose_raw(["+experiment=math_1p5b", "trainer.start_timeout_s=2400"]))
    start_trainer(
        config,
        tmp_path,
        torch_threads=1,
        placement=plan_placement(config),
        group=None,
        on_cleanup=lambda what, close: None,  # the stand-in group holds nothing to close
    )
    assert received["start_timeout_s"] == 2400.0


def test_a_megatron_lora_role_refits_the_groups_adapter_alone(tmp_path, monkeypatch):
    """With LoRA the Megatron role hands the generation server the adapter its ranks export
    (PEFT's format, as the torch trainer's), whatever the engine: no checkpoint on disk, no
    broadcast."""
    import gymrl.trainer.megatron.group as megatron_group
    from gymrl.run.adapter import AdapterWeights

    adapter = AdapterWeights({"r": 1, "lora_alpha": 2}, {"k.lora_A.weight": torch.ones(1, 2)})

    class Ranks:
        def __init__(self, config, **kwargs):
            del config, kwargs

        def export_adapter(self):
            return adapter

    monkeypatch.setattr(megatron_group, "MegatronTrainerGroup", Ranks)
    config = validate_config(
        compose_raw(
            [
                "trainer=megatron",
                "cluster=slurm_8gpu",
                "policy=qwen2p5_math_1p5b",
                "trainer.lora.enabled=true",
            ]
        )
    )
    role = start_trainer(
        config,
        tmp_path,
        torch_threads=1,
        placement=plan_placement(config),
        group=None,
        on_cleanup=lambda what, close: None,  # the stand-in group holds nothing to close
    )
    generation = RecordingGeneration.remote()
    role.refit(generation, 3)
    ((version, received),) = ray.get(generation.received.remote())
    assert version == 3 and received.config == adapter.config
    assert torch.equal(received.tensors["k.lora_A.weight"], adapter.tensors["k.lora_A.weight"])
    assert not (tmp_path / "refit").exists()
