"""The torch trainer on a real tiny Llama: one GRPO step moves the policy the right way."""

import pytest
import torch
from transformers import LlamaModel

from gymrl.algo.loss import sequence_logprobs
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.loading import build_tiny_llama
from gymrl.trainer.torch_trainer import TorchPolicyTrainer


@pytest.fixture(params=["float32", "bfloat16"])
def trainer(tokenizer, request):
    compute_dtype = request.param
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
    )
    config = TorchTrainerConfig(micro_batch_size=2, optimizer=TorchOptimizerConfig(lr=1e-2))
    return TorchPolicyTrainer(
        model,
        config,
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=2,
        compute_dtype=compute_dtype,
    )


def _device(trainer):
    return next(trainer.model.parameters()).device


def _trajectory(trainer, prompt, generation, reward, group="g"):
    """A trajectory whose generation log-probabilities are the current policy's (on-policy)."""
    ids = torch.tensor([prompt + generation], device=_device(trainer))
    mask = [0] * len(prompt) + [1] * len(generation)
    with torch.no_grad():
        logprobs = sequence_logprobs(trainer.model(input_ids=ids).logits, ids, 1.0)[0].tolist()
    logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
    return Trajectory(prompt + generation, mask, logprobs, reward, "agent", group, 0)


def _sequence_logprob(trainer, trajectory):
    ids = torch.tensor([trajectory.token_ids], device=_device(trainer))
    with torch.no_grad():
        logprobs = sequence_logprobs(trainer.model(input_ids=ids).logits, ids, 1.0)[0].cpu()
    return float((logprobs * torch.tensor(trajectory.loss_mask)).sum())


def test_a_step_raises_the_rewarded_episode_and_lowers_the_other(trainer):
    good = _trajectory(trainer, [5, 6, 7, 8], [100, 101, 102], reward=1.0)
    bad = _trajectory(trainer, [5, 6, 7, 8], [200, 201, 202], reward=0.0)
    before = (_sequence_logprob(trainer, good), _sequence_logprob(trainer, bad))
    metrics = trainer.train_step([good, bad], torch.tensor([1.0, -1.0]))
    after = (_sequence_logprob(trainer, good), _sequence_logprob(trainer, bad))
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.weight_version == 1
    assert metrics["num_tokens"] == 6.0 and metrics["num_sequences"] == 2.0
    assert metrics["importance_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["grad_norm"] > 0 and metrics["lr"] == 1e-2


def test_micro_batches_give_the_full_batch_gradient(trainer, tokenizer):
    trajectories = [
        _trajectory(trainer, [5, 6, 7], [10 + i, 20 + i, 30 + i][: 1 + i % 3], reward=float(i % 2))
        for i in range(5)
    ]
    advantages = torch.tensor([0.5, -1.0, 2.0, -0.5, 1.0])
    trainer._config = TorchTrainerConfig(micro_batch_size=5)
    batch = collate(trajectories, advantages=advantages, pad_token_id=0)
    loss, _ = trainer._micro_batch_loss(batch, None, 6.0, [t.agent for t in trajectories])
    (full,) = torch.autograd.grad(loss, trainer.model.model.embed_tokens.weight)
    parts = []
    for chunk in ([0, 1], [2, 3], [4]):
        part = collate(
            [trajectories[i] for i in chunk], advantages=advantages[chunk], pad_token_id=0
        )
        loss, _ = trainer._micro_batch_loss(part, None, 6.0, [trajectories[i].agent for i in chunk])
        parts.append(torch.autograd.grad(loss, trainer.model.model.embed_tokens.weight)[0])
    torch.testing.assert_close(sum(parts), full, rtol=1e-4, atol=1e-6)


def test_a_batch_without_generated_tokens_is_refused(trainer):
    masked = Trajectory([], [], [], 1.0, "agent", "g", 0)
    with pytest.raises(ValueError, match="no trajectory with generated tokens"):
        trainer.train_step([masked], torch.tensor([0.0]))


def test_a_model_without_an_output_layer_is_refused(trainer):
    """A bare decoder (no lm_head) has no vocabulary projection to train through."""
    trajectory = _trajectory(trainer, [5, 6], [7, 8], reward=1.0)
    bare = TorchPolicyTrainer(
        LlamaModel(trainer.model.config),
        TorchTrainerConfig(),
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )
    with pytest.raises(ValueError, match="LlamaModel has no output layer"):
        bare.train_step([trajectory], torch.tensor([1.0]))


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(trainer, tmp_path):
    trajectory = _trajectory(trainer, [5, 6], [7, 8], reward=1.0)
    trainer.train_step([trajectory], torch.tensor([1.0]))
    saved = {k: v.clone() for k, v in trainer.export_weights().items()}
    path = trainer.save_checkpoint(tmp_path, step=1, data_state={"position": 7})
    trainer.train_step([trajectory], torch.tensor([1.0]))
    state = trainer.load_checkpoint(path)
    assert state["step"] == 1 and state["data_state"] == {"position": 7}
    assert trainer.weight_version == 1
    for name, tensor in trainer.export_weights().items():
        torch.testing.assert_close(tensor, saved[name])


def test_weights_export_in_the_dtypes_asked_for_and_otherwise_their_own(trainer):
    own = trainer.export_weights()
    name = next(n for n in own if n.endswith("q_proj.weight"))
    asked = trainer.export_weights({name: torch.bfloat16})
    assert asked[name].dtype == torch.bfloat16
    assert torch.equal(asked[name], own[name].to(torch.bfloat16))
    assert all(asked[n].dtype == own[n].dtype for n in own if n != name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_on_cuda_trains_where_the_model_is(tokenizer, dtype):
    """The torch trainer on a GPU: batches follow the model to cuda, the step moves the policy
    the right way, and exported weights come back on the CPU for the engine."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from gymrl.model.policy import DTYPES

    model = build_tiny_llama(
        tokenizer,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        seed=0,
        dtype=DTYPES[dtype],
    ).to("cuda")
    config = TorchTrainerConfig(micro_batch_size=1, optimizer=TorchOptimizerConfig(lr=1e-2))
    on_gpu = TorchPolicyTrainer(
        model,
        config,
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="auto",
    )
    good = _trajectory(on_gpu, [5, 6, 7, 8], [100, 101, 102], reward=1.0)
    bad = _trajectory(on_gpu, [5, 6, 7, 8], [200, 201, 202], reward=0.0)
    before = (_sequence_logprob(on_gpu, good), _sequence_logprob(on_gpu, bad))
    metrics = on_gpu.train_step([good, bad], torch.tensor([1.0, -1.0]))
    after = (_sequence_logprob(on_gpu, good), _sequence_logprob(on_gpu, bad))
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["num_tokens"] == 6.0 and metrics["grad_norm"] > 0
    assert next(on_gpu.model.parameters()).device.type == "cuda"
    weights = on_gpu.export_weights()
    assert all(tensor.device.type == "cpu" for tensor in weights.values())
    assert next(iter(weights.values())).dtype == DTYPES[dtype]
