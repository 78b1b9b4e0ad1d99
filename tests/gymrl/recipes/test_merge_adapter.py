"""`python -m gymrl.recipes.merge_adapter`: a LoRA checkpoint becomes a Hugging Face folder that
computes what the trainer's adapted model computes."""

import torch
from transformers import AutoModelForCausalLM

from gymrl.recipes.merge_adapter import main
from gymrl.run.checkpoint import TrainerState, capture_rng_state, save_checkpoint
from tests.support.lora_checkpoint import save_lora_checkpoint

SMOKE = ["+experiment=smoke", "run.seed=3"]


def test_the_merged_folder_computes_what_the_adapted_model_does(tmp_path):
    trainer, _ = save_lora_checkpoint(tmp_path / "run" / "checkpoints", SMOKE, step=2)
    out = tmp_path / "merged"
    assert main([str(tmp_path / "run"), str(out), *SMOKE]) == 0  # the run: its newest step
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name in merged.state_dict())
    ids = torch.tensor([[5, 6, 7, 8, 100, 101, 102]])
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert (out / "tokenizer_config.json").is_file()


def test_an_existing_output_or_a_full_checkpoint_is_refused(tmp_path, capsys):
    _, folder = save_lora_checkpoint(tmp_path / "checkpoints", SMOKE, step=1)
    assert main([str(folder), str(tmp_path), *SMOKE]) == 2
    assert "exists; name a new folder" in capsys.readouterr().err
    model = torch.nn.Linear(2, 2)
    state = TrainerState(1, 1, {"position": 0}, [capture_rng_state()])
    full = save_checkpoint(
        tmp_path / "full", model, torch.optim.AdamW(model.parameters()), state, keep_last=1
    )
    assert main([str(full), str(tmp_path / "out"), *SMOKE]) == 2
    assert "holds every weight, not a LoRA adapter" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
