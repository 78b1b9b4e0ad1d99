"""`python recipes/grpo.py +experiment=sglang_cpu_smoke` as written (no override but the run's
folder): the real SGLang server on this CPU from the venv `make sglang-venv` made in this
checkout, with the CPU stand-ins its config names; the torch trainer broadcasting its weights to
it over gloo after every step, each refit read back from the server and compared with what was
sent (`verify_method: read_back`, `verify_every: 1`), the built-in agents, the parity gate at
step 1; a non-zero loss. The server held what the trainer sent at every refit (else the run
stops), and what it was sent last scores its greedy answers otherwise than the weights it
started with: a refit that loads nothing fails.

Marked `slow` and `sglang_cpu`: `.ci/run` builds the venv before the slow suite.
"""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.loading import load_pretrained
from gymrl.model.tokens import model_end_token_ids
from gymrl.run.checkpoint import MODEL_FILE
from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu]


def test_the_real_server_serves_a_training_run_refit_every_step(tmp_path, smollm2_dir, tokenizer):
    # A venv `make` has not made stops the run at once, naming the target.
    done = run_recipe(
        tmp_path, "+experiment=sglang_cpu_smoke", "logger.wandb.mode=disabled", timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "refit over nccl, checked by read_back" in done.stdout  # the plan's generation line
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert records[0]["parity/passed"] == 1  # the real server's log-probs are the trainer's
    for record in records:
        assert record["async/weight_version"] == record["step"]  # refit after every step
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0
        assert record["perf/train_tokens_per_s"] > 0
    # A loss of 0 is a step whose every group's rewards tied (no advantage, no update); groups of
    # 4 with guess_number's graded rewards make that rare for one step and unheard of for both.
    assert any(record["train/loss"] != 0 for record in records), records
    # What the server was refitted to last (the read-back check compared it with the server's
    # at that refit) scores its answers otherwise than what it started with. (Not the answers
    # themselves: two steps at lr 1e-5 need not flip a greedy token, and once did not; any
    # update moves the log-probabilities.)
    trained = tmp_path / "checkpoints" / "step_2"
    assert _greedy(smollm2_dir, tokenizer, trained) != _greedy(smollm2_dir, tokenizer, None)


def _greedy(
    folder: Path, tokenizer, checkpoint: Path | None
) -> list[tuple[list[int], list[float]]]:
    """Greedy answers of the model in `folder`, with a checkpoint's weights if given, to three
    arithmetic questions, with their log-probabilities."""
    model = load_pretrained(folder, torch.float32)
    if checkpoint is not None:
        load_model(model, str(checkpoint / MODEL_FILE), strict=True)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for question in ("What is 17 + 25?", "What is 6 times 7?", "What is 100 - 58?")
    ]
    engine = TorchGenerationEngine.from_config(
        model,
        TorchGenerationConfig(max_batch_size=3, prefix_cache_tokens=0, decode_path="transformers"),
        seed=0,
        compute_dtype="float32",
        eos_token_ids=model_end_token_ids(folder),
    )
    try:
        outputs = engine.generate(
            [
                GenerationRequest(list(prompt), SamplingParams(max_new_tokens=24, temperature=0.0))
                for prompt in prompts
            ]
        )
    finally:
        engine.close()
    return [(list(output.token_ids), list(output.logprobs)) for output in outputs]
