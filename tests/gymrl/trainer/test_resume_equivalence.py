"""Resume equals an uninterrupted run on the CPU torch path (sync mode, fixed seeds), bit-exact.

What a sync run carries from step to step is: the trainer's weights and AdamW state, the
process's RNG streams, and the position in the row stream (gymrl/recipes/training.py records it
before the producer may take the next step's rows). Here a run of N steps and a run stopped
after K steps, checkpointed, rebuilt from a *different* initialisation and resumed, must agree
exactly on the rows each step draws, the metrics of every step, and the weights and optimizer
state after N. The same holds for a LoRA run resumed from its PEFT-format adapter (with adapter
dropout, whose masks come from the restored RNG).
Episodes are derived from the drawn rows with the real tokenizer, and their sampled parts and
rewards come from torch's RNG, so a resume that lost the RNG state or the data position differs.

Bit-exact holds because both runs execute the same float operations in the same order on one
CPU thread. What this does not cover is generation: the torch engine's batches depend on which
requests arrive together, so end-to-end episodes are not reproducible between runs even without
a stop; async mode differs further (see docs/reliability.md: rows in flight are skipped).
"""

import pytest
import torch

from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import LoraConfig, TorchOptimizerConfig, TorchTrainerConfig
from gymrl.experience.rows import RowStream
from gymrl.model.loading import build_tiny_llama
from gymrl.trainer.torch_trainer import TorchPolicyTrainer
from nemo_gym_ext.envs.registry import make_rows

STEPS, STOP_AFTER, PROMPTS, GENERATIONS = 4, 2, 2, 3
LORA = {
    "full": LoraConfig(),
    "lora": LoraConfig(enabled=True, rank=4, dropout=0.1, target_modules=("q_proj", "up_proj")),
}


def _trainer(tokenizer, seed, lora):
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
    )
    config = TorchTrainerConfig(
        micro_batch_size=2, optimizer=TorchOptimizerConfig(lr=1e-2), lora=LORA[lora]
    )
    return TorchPolicyTrainer(
        model,
        config,
        LossConfig(kl_coef=0.0),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=2,
        compute_dtype="float32",
    )


def _episodes(tokenizer, rows, step):
    """GRPO groups of the drawn rows: the row's id as prompt, RNG-sampled 'generations'."""
    trajectories = []
    for _, row in rows:
        prompt = tokenizer.encode(row["id"])[:8]
        for _ in range(GENERATIONS):
            generated = torch.randint(1, 500, (4,)).tolist()
            trajectories.append(
                Trajectory(
                    token_ids=prompt + generated,
                    loss_mask=[0] * len(prompt) + [1] * len(generated),
                    generation_logprobs=[0.0] * len(prompt) + (-torch.rand(4)).tolist(),
                    reward=float(torch.rand(())),
                    agent="a",
                    group_id=row["id"],
                    weight_version=step,
                )
            )
    return trajectories


def _run(tokenizer, trainer, stream, steps, log):
    for step in steps:
        rows = [stream.next() for _ in range(PROMPTS)]
        trajectories = _episodes(tokenizer, rows, step)
        advantages = grpo_advantages(
            torch.tensor([t.reward for t in trajectories]),
            [t.group_id for t in trajectories],
            normalize_by_std=True,
            eps=1e-6,
        )
        metrics = trainer.train_step(trajectories, advantages)
        log.append((step, [position for position, _ in rows], metrics))


def _optimizer_tensors(trainer):
    state = trainer.optimizer.state_dict()["state"]
    return {(i, k): v for i, entry in state.items() for k, v in entry.items()}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("lora", sorted(LORA))
def test_a_resumed_run_matches_an_uninterrupted_one_bit_for_bit(
    tokenizer, tmp_path, one_thread, lora
):
    rows = make_rows("calculator", 16, seed=0)

    torch.manual_seed(0)
    straight, straight_log = _trainer(tokenizer, seed=0, lora=lora), []
    _run(tokenizer, straight, RowStream(rows), range(STEPS), straight_log)

    torch.manual_seed(0)
    first, resumed_log = _trainer(tokenizer, seed=0, lora=lora), []
    stream = RowStream(rows)
    _run(tokenizer, first, stream, range(STOP_AFTER), resumed_log)
    path = first.save_checkpoint(tmp_path, STOP_AFTER, {"position": stream.position})
    del first
    torch.manual_seed(123)  # the new process's RNG: whatever it is, the checkpoint's wins
    # A LoRA checkpoint holds the adapter alone: the base is the policy's own (its seed), and
    # the adapter this trainer draws under the other RNG state is what the checkpoint replaces.
    second = _trainer(tokenizer, seed=1 if lora == "full" else 0, lora=lora)
    state = second.load_checkpoint(path)
    assert state["step"] == STOP_AFTER and second.weight_version == STOP_AFTER
    _run(
        tokenizer,
        second,
        RowStream(rows, state["data_state"]["position"]),
        range(STOP_AFTER, STEPS),
        resumed_log,
    )

    assert [(s, p) for s, p, _ in resumed_log] == [(s, p) for s, p, _ in straight_log]
    assert [m for _, _, m in resumed_log] == [m for _, _, m in straight_log]
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], tensor), name
    expected, actual = _optimizer_tensors(straight), _optimizer_tensors(second)
    assert expected.keys() == actual.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key
