"""A refit from the Megatron trainer into the real SGLang 0.5.23 server, on this CPU over gloo.

Needs both role venvs: it runs under the Megatron venv's python (`-m megatron`) and starts the
server from the SGLang venv (`SGLANG_VENV`, default `.venv-sglang`, as the `sglang_cpu` tests);
without that venv it is skipped. The server and the trainer hold the generated tiny Llama
(`tiny_llama`); the trainer runs in a process of its own (`megatron_refit.refit_run`).
"""

from __future__ import annotations

import multiprocessing

import pytest

from nemo_gym_ext.ports import free_port
from tests.gymrl.trainer.megatron_refit import refit_run
from tests.support.real_sglang import VENV, start_cpu_server

pytestmark = pytest.mark.megatron

RUN_DEADLINE_S = 600.0


@pytest.fixture(scope="module")
def tiny_server(tiny_llama, tmp_path_factory):
    if not (VENV / "bin" / "python").is_file():
        pytest.skip(
            f"no SGLang venv at {VENV}: run `make sglang-venv` (or set SGLANG_VENV) for the "
            "refit from Megatron into the real SGLang server"
        )
    folder, _ = tiny_llama
    server = start_cpu_server(
        folder, tmp_path_factory.mktemp("sglang") / "server.log", context_length=256
    )
    try:
        yield server
    finally:
        server.stop()


def test_megatron_refit_into_the_real_sglang_server(
    megatron_runtime, tiny_llama, tiny_server, tokenizer, tmp_path
):
    """The server's weights are randomised, then the trainer's unchanged weights refit them: the
    server's checksum is the one it loaded from the checkpoint, so every tensor it holds was
    written by a tensor the trainer sent under its Hugging Face name (SGLang skips a name it does
    not know without a word, and a tensor it skipped would still be random), and its greedy ids
    and log-probs are the ones before. After one train step and a refit both change."""
    import torch

    folder, _ = tiny_llama
    prompt = list(tokenizer("Name three colours.", add_special_tokens=False)["input_ids"])
    out = tmp_path / "refit.pt"
    process = multiprocessing.get_context("spawn").Process(
        target=refit_run,
        args=(0, str(folder), tiny_server.base_url, prompt, free_port(), str(out)),
    )
    process.start()
    process.join(RUN_DEADLINE_S)
    if process.is_alive():
        process.kill()
        process.join(30)
        pytest.fail(f"the Megatron refit run did not finish within {RUN_DEADLINE_S} s")
    assert process.exitcode == 0, f"the Megatron refit run failed (exit {process.exitcode})"
    seen = torch.load(out, weights_only=False)

    assert seen["checksum_randomised"] != seen["checksum_loaded"]
    assert seen["checksum_refit"] == seen["checksum_loaded"]
    loaded, unchanged, trained = seen["loaded"], seen["unchanged"], seen["trained"]
    assert unchanged["weight_version"] == 1 and trained["weight_version"] == 2
    assert unchanged["token_ids"] == loaded["token_ids"]
    assert unchanged["logprobs"] == pytest.approx(loaded["logprobs"], abs=1e-6)

    assert seen["checksum_trained"] != seen["checksum_loaded"]
    assert trained["token_ids"] != loaded["token_ids"]
    gaps = [abs(a - b) for a, b in zip(trained["logprobs"], loaded["logprobs"], strict=False)]
    assert max(gaps) > 1e-3, gaps
    # Every tensor of the tiny Llama, in float32 (tied embeddings: no lm_head).
    parameters = sum(
        t.numel() for n, t in tiny_llama[1].state_dict().items() if n != "lm_head.weight"
    )
    assert seen["bytes"] == seen["trained_bytes"] == 4 * parameters
    print(
        f"\nrefit from Megatron into the real SGLang server: {seen['bytes']} bytes "
        f"({len(seen['sent_names'])} tensors), {seen['seconds']:.2f} s unchanged, "
        f"{seen['trained_seconds']:.2f} s after the step"
    )
