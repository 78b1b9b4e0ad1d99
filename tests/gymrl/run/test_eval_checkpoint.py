"""Which checkpoint `eval.checkpoint` names: one folder, a checkpoints/ folder or a run folder;
missing, incomplete and damaged checkpoints are refused naming the key and what to do, through
`gymrl.run.checkpoint`'s own verification; the weights come back whole (tied tensors too)."""

import pytest
import torch

from gymrl.run.checkpoint import (
    COMPLETE_MARKER,
    TrainerState,
    capture_rng_state,
    save_checkpoint,
    write_manifest,
)
from gymrl.run.eval_checkpoint import (
    CheckpointRefusedError,
    checkpoint_adapter,
    checkpoint_weights,
    choose_checkpoint,
)
from tests.support.lora_checkpoint import save_lora_checkpoint


class TiedLM(torch.nn.Module):
    """Embedding shared with the output head, as SmolLM2's: the file holds it once."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _save(root, step, seed=0):
    model = TiedLM(seed)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainerState(step, step, {"position": step}, [capture_rng_state()])
    return model, save_checkpoint(root, model, optimizer, state, keep_last=5)


def test_a_run_folder_or_its_checkpoints_folder_means_the_newest_that_verifies(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    _save(checkpoints, 2)
    newest = _save(checkpoints, 4)[1]
    for path in (tmp_path / "run", checkpoints):
        chosen, rejected = choose_checkpoint(str(path))
        assert (chosen.folder, chosen.step, chosen.label, rejected) == (newest, 4, "step_4", [])
    (newest / "model.safetensors").write_bytes(b"garbage")
    chosen, rejected = choose_checkpoint(str(tmp_path / "run"))
    assert chosen.step == 2
    assert len(rejected) == 1 and "step_4" in rejected[0]


def test_one_checkpoint_named_directly_is_verified(tmp_path):
    _, folder = _save(tmp_path, 3)
    chosen, _ = choose_checkpoint(str(folder))
    assert chosen.step == 3
    (folder / "gymrl_state.json").write_text("{}")
    with pytest.raises(
        CheckpointRefusedError,
        match=r"eval.checkpoint=.*fails its manifest.*"
        r"gymrl_state.json has \d+ bytes",
    ):
        choose_checkpoint(str(folder))


def test_missing_incomplete_and_empty_choices_say_what_to_point_at(tmp_path):
    with pytest.raises(CheckpointRefusedError, match=r"eval.checkpoint='.*nowhere' does not exist"):
        choose_checkpoint(str(tmp_path / "nowhere"))
    _, folder = _save(tmp_path / "checkpoints", 3)
    (folder / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointRefusedError, match="not a complete checkpoint"):
        choose_checkpoint(str(folder))
    with pytest.raises(CheckpointRefusedError, match="no complete checkpoint under"):
        choose_checkpoint(str(tmp_path))


def test_a_checkpoint_without_torch_weights_points_at_a_hugging_face_export(tmp_path):
    _, folder = _save(tmp_path, 1)
    (folder / "model.safetensors").unlink()
    write_manifest(folder)  # a Megatron checkpoint verifies, but holds no model.safetensors
    with pytest.raises(CheckpointRefusedError, match=r"policy\.source=pretrained"):
        choose_checkpoint(str(folder))


def test_the_weights_hold_every_name_of_the_model_tied_ones_included(tmp_path):
    model, folder = _save(tmp_path, 1, seed=7)
    chosen, _ = choose_checkpoint(str(folder))
    weights = checkpoint_weights(chosen)
    assert set(weights) == set(model.state_dict())
    fresh = TiedLM(seed=0)
    fresh.load_state_dict(weights, strict=True)  # what the torch engine's update_weights does
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)


def test_a_lora_checkpoint_is_chosen_and_read_as_its_adapter(tmp_path):
    trainer, folder = save_lora_checkpoint(tmp_path / "checkpoints", ["+experiment=smoke"], 4)
    chosen, _ = choose_checkpoint(str(tmp_path))
    assert chosen.folder == folder and chosen.step == 4 and chosen.holds_adapter
    adapter = checkpoint_adapter(chosen)
    expected = trainer.export_adapter()
    assert adapter.tensors.keys() == expected.tensors.keys()
    for key, tensor in expected.tensors.items():
        assert torch.equal(adapter.tensors[key], tensor), key
